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


class Standalone(Tensors):
    """A part whose rank also needs a file another rank writes for all (DeepSpeed's model states under ZeRO 0-2):
    ``shared.pt`` goes to the fast-tier part only."""

    stands_alone = True

    def stage_part(self):
        staged = {k: v.clone() for k, v in self.tensors.items()}
        return {self.name: lambda f: torch.save(staged, f)}, {"shared.pt": lambda f: torch.save({"n": 7}, f)}

    def load_files(self, read):
        super().load_files(read)
        self.shared = torch.load(io.BytesIO(read("shared.pt")), weights_only=True) if "shared.pt" in read.names else None


def test_a_part_that_stands_alone_goes_to_the_fast_tier_with_its_extra_files_and_resumes_from_there(tmp_path):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    with CheckpointManager(url, interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
        ckpt.maybe_save(1, {"extra": Standalone("extra.pt", a=torch.arange(3.0))})
        ckpt.maybe_save(2, {"extra": Standalone("extra.pt", a=torch.arange(3.0) + 2)})
        ckpt.wait()
        part = layout.read_manifest(ckpt.fast.folder.storage(0), 2)
        assert {"extra.pt", "shared.pt"} <= set(part.files), "the part holds the file the step's rank writes for all"
        ckpt.close(clean=False)
    assert layout.committed_steps(Storage(url)) == [], "only the fast tier was due"
    resumed = {"extra": Standalone("extra.pt")}
    with CheckpointManager(url, fast_dirpath=fast, fast_interval=1) as ckpt:
        assert ckpt.resume(resumed) == 2 and ckpt.resumed_source == "fast tier, own node"
        ckpt.close(final=False)
    assert torch.equal(resumed["extra"].tensors["a"], torch.arange(3.0) + 2) and resumed["extra"].shared == {"n": 7}


def test_a_part_that_does_not_stand_alone_is_saved_to_the_durable_tier_only(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=100, fast_dirpath=str(tmp_path / "fast"), fast_interval=1) as ckpt:
        ckpt.maybe_save(1, {"extra": Tensors("extra.pt", a=torch.zeros(2))})
        ckpt.wait()
        assert ckpt.fast.committed is None
    assert layout.committed_steps(Storage(url)) == [1]
    assert "this run saves to the durable tier only" in caplog.text
