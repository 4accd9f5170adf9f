"""Parts of a state that save themselves as files of their own (as a DeepSpeed engine does): staged at the
save, written in the background, listed with their checksums in the manifest, checked when read back."""

from __future__ import annotations

import io

import pytest
import torch

from ft_checkpoint import CheckpointManager, ConfigError
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import assert_same, make, train_step


class Tensors:
    """Keeps named tensors in a file of its own, ``torch.save``d from a copy taken at the save."""

    def __init__(self, name: str, **tensors: torch.Tensor) -> None:
        self.name, self.tensors = name, tensors

    def stage_files(self):
        staged = {k: v.clone() for k, v in self.tensors.items()}  # what the background writer will write
        return {self.name: lambda f: torch.save(staged, f)}

    def load_files(self, read):
        self.tensors = torch.load(io.BytesIO(read(self.name)), weights_only=True)

    def describe(self):
        return {"tensors": sorted(self.tensors)}


def test_own_files_are_written_listed_and_read_back(tmp_path):
    url = str(tmp_path / "ckpt")
    state = {**make(), "extra": Tensors("extra.pt", a=torch.arange(4.0))}
    with CheckpointManager(url, interval=1) as ckpt:
        train_step(state)
        ckpt.save(1, state)
        state["extra"].tensors["a"] += 100  # after the save returned: the step keeps what was staged
        ckpt.wait()
    manifest = layout.read_manifest(Storage(url), 1)
    assert "extra.pt" in manifest.files and manifest.metadata["extra"] == {"tensors": ["a"]}
    resumed = {**make(seed=5), "extra": Tensors("extra.pt")}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert torch.equal(resumed["extra"].tensors["a"], torch.arange(4.0))
    assert_same({k: v for k, v in resumed.items() if k != "extra"}, {k: v for k, v in state.items() if k != "extra"})


def test_a_corrupt_own_file_falls_back_to_the_previous_step(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {"extra": Tensors("extra.pt", a=torch.zeros(3))}, block=True)
        ckpt.save(2, {"extra": Tensors("extra.pt", a=torch.ones(3))}, block=True)
    path = tmp_path / "ckpt" / layout.step_dir(2) / "extra.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    resumed = {"extra": Tensors("extra.pt")}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert torch.equal(resumed["extra"].tensors["a"], torch.zeros(3))
    assert "extra.pt: does not match its checksum" in caplog.text


@pytest.mark.parametrize("name", ["manifest.json", "metadata.json", "rank_00000.pt", "__0_0.distcp", "../x.pt"])
def test_own_files_cannot_take_ft_checkpoints_names(tmp_path, name):
    with CheckpointManager(str(tmp_path / "ckpt"), interval=1) as ckpt:
        ckpt.save(1, {"extra": Tensors(name, a=torch.zeros(1))})
        with pytest.raises(Exception, match="may not be named"):
            ckpt.wait()


def test_two_parts_staging_the_same_file_name_is_an_error(tmp_path):
    with CheckpointManager(str(tmp_path / "ckpt"), interval=1) as ckpt:
        with pytest.raises(ConfigError, match="stages a file named 'same.pt'"):
            ckpt.save(1, {"a": Tensors("same.pt", x=torch.zeros(1)), "b": Tensors("same.pt", y=torch.zeros(1))})
