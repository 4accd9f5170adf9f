"""Format 2 round trips: every dtype and shape the raw format stores, written by a thread or by a writer
process, at the priority asked for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format import layout
from ft_checkpoint.format.shards import DTYPES, byte_view
from ft_checkpoint.store.storage import Storage


def every_kind() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point or dtype.is_complex:
            try:
                base = torch.randn(5, 3, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32)
                out[name] = base.to(dtype)
            except (RuntimeError, TypeError):  # a dtype without conversions (float8_e8m0fnu): its raw bytes
                out[name] = torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8).view(dtype)
        elif dtype == torch.bool:
            out[name] = torch.rand(5, 3, generator=g) > 0.5
        else:
            info = torch.iinfo(dtype)
            out[name] = torch.randint(max(info.min, -1000), min(info.max, 1000), (5, 3), generator=g).to(dtype)
    big = torch.randn(8, 6, generator=g)
    out.update({"zero_dim": torch.tensor(3.25), "empty": torch.empty(0, 4), "empty_3d": torch.zeros(2, 0, 3),
                "transposed": big.t(), "sliced": big[1::2, ::3], "expanded": torch.arange(4.0).expand(3, 4)})
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, and for dtypes without comparison ops)."""
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and bytes(byte_view(a)) == bytes(byte_view(b))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path, writer):
    saved = every_kind()
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1, writer=writer, writers=2) as ckpt:
        ckpt.save(1, {"t": saved}, block=True)
    names = sorted(layout.read_manifest(Storage(url), 1).files)
    assert {"__0_0.distcp", "__0_1.distcp", "metadata.json", "rank_00000.pt"} == set(names)
    into = {k: torch.zeros_like(v.contiguous()) for k, v in saved.items()}
    fresh: dict = {"t": {}}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume({"t": into}) == 1
        assert ckpt.resume(fresh) == 1  # no tensors to fill: new ones are made
    for k, v in saved.items():
        assert same(into[k], v), k
        assert same(fresh["t"][k], v), k


def test_the_thread_writer_runs_at_the_priority_asked_for(tmp_path):
    seen = []

    def hook(phase: str, step: int) -> None:
        if phase == "writing":
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    with CheckpointManager(str(tmp_path / "ckpt"), interval=1, writer_priority=7) as ckpt:
        ckpt.engine.phase_hook = hook
        ckpt.save(1, {"w": torch.ones(10)}, block=True)
        assert seen == [7], "the writer thread's nice value, read back from the OS"
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0, "training's thread is untouched"


def wait_until_dead(pid: int) -> None:
    """Until ``pid`` has exited (a zombie, or gone)."""
    for _ in range(3000):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still runs 30 s after SIGKILL")


def test_the_writer_process_runs_at_the_priority_asked_for_and_is_replaced_if_it_dies(tmp_path):
    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(1000.0)}
    with CheckpointManager(url, interval=1, writer="process", writer_priority=11) as ckpt:
        ckpt.save(1, state, block=True)
        pids = ckpt.engine.writer_pids
        assert len(pids) == 2 and os.getpid() not in pids  # writers=2 by default
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [11, 11]
        os.kill(pids[0], signal.SIGKILL)
        wait_until_dead(pids[0])  # on a busy machine a SIGKILLed process can run on for a while
        state["w"] += 1
        ckpt.save(2, state, block=True)  # a dead writer is replaced before the next save
        assert pids[0] not in ckpt.engine.writer_pids
    resumed = {"w": torch.zeros(1000)}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 2
    assert torch.equal(resumed["w"], torch.arange(1000.0) + 1)


def test_a_writer_process_killed_in_the_middle_of_a_write_loses_no_save(tmp_path):
    """The OOM killer or an operator SIGKILLs a writer process while it writes a shard file: the save used to
    fail ("the writer process died"); the bytes are still staged, so the training process writes that file
    itself and the step commits. (Also the race the test above met: a writer killed just before a save still
    looked alive.)"""
    url = str(tmp_path / "ckpt")
    state = {"w": torch.randn(48 << 20 // 4)}  # 48 MiB: its write takes long enough to be hit
    killed, stop = threading.Event(), threading.Event()
    with CheckpointManager(url, interval=1, writer="process", writers=1) as ckpt:
        ckpt.save(1, state, block=True)
        pid = ckpt.engine.writer_pids[0]
        step2 = tmp_path / "ckpt" / layout.step_dir(2)

        def kill_once_writing() -> None:
            while not stop.is_set():
                if step2.exists() and any(f.name.endswith(".distcp") for f in step2.iterdir()):
                    os.kill(pid, signal.SIGKILL)
                    killed.set()
                    return

        killer = threading.Thread(target=kill_once_writing, daemon=True)
        killer.start()
        state["w"] += 1
        ckpt.save(2, state, block=True)
        stop.set()
        killer.join()
        assert killed.is_set() and ckpt.last_save is not None and ckpt.last_save.committed
        ckpt.save(3, state, block=True)  # a new writer process took the dead one's place
        assert ckpt.engine.writer_pids and pid not in ckpt.engine.writer_pids
    resumed = {"w": torch.zeros_like(state["w"])}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 3
    assert torch.equal(resumed["w"], state["w"])


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_a_staged_tensor_kept_after_the_manager_closed_stays_readable(tmp_path):
    """Closing the staging arena unmapped its memory while a staged tensor could still be referenced (the
    frames of a failed save's traceback, which pytest printed): reading it crashed the process with a
    segmentation fault. The mapping now lives as long as any tensor viewing it."""
    script = ("import torch\n"
              "from ft_checkpoint.save.staging import Stager\n"
              "s = Stager(shared=True)\n"
              "kept = s.stage({'w': torch.arange(1000.0)})['w']\n"
              "s.close()\n"
              "print(float(kept.sum()))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "499500.0", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_the_writer_process_imports_nothing_from_the_working_directory(tmp_path):
    """A ``tenacity.py`` planted in the directory a training runs from: the training imports the real one (its
    script's directory, not the working directory, is on its path); the writer process, started with ``-m``,
    had the working directory first on its path and ran the planted one."""
    scripts, workdir, marker = tmp_path / "scripts", tmp_path / "work", tmp_path / "planted-module-ran"
    scripts.mkdir()
    workdir.mkdir()
    (workdir / "tenacity.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (scripts / "train.py").write_text(
        "import sys\nimport torch\nfrom ft_checkpoint import CheckpointManager\n"
        "with CheckpointManager(sys.argv[1], interval=1, writer='process', announce=False) as ckpt:\n"
        "    ckpt.save(1, {'w': torch.arange(1000.0)}, block=True)\n"
        "    assert ckpt.engine.writer_pids\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(scripts / "train.py"), str(tmp_path / "ckpt")], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists(), "the writer process ran a module from the training's working directory"
    assert layout.read_manifest(Storage(str(tmp_path / "ckpt")), 1).step == 1
