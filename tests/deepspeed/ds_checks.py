"""Checks that need a live DeepSpeed engine, run under torchrun (1 rank); each rank reports into OUT.

    torchrun --nproc-per-node 1 ds_checks.py OUT internals     # ft_checkpoint/integrations/_deepspeed_internals.py
    torchrun --nproc-per-node 1 ds_checks.py OUT refusals      # what DeepSpeedState refuses; two engines
    torchrun --nproc-per-node 1 ds_checks.py OUT dp-change DIR # a resume of a 2-rank ZeRO-2 directory
    torchrun --nproc-per-node 1 ds_checks.py OUT universal DIR # load a ds_to_universal conversion

Each check writes ``{"check": name, "ok": bool, "detail": ...}`` to ``OUT/report.rank0.jsonl``; an
exception in one check is its failure (named with the exception), the others still run.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ft_checkpoint import CheckpointManager, ConfigError, StateMismatchError  # noqa: E402
from ft_checkpoint.integrations import _deepspeed_internals as internals  # noqa: E402
from ft_checkpoint.integrations.deepspeed import DeepSpeedState  # noqa: E402
from tests.deepspeed.ds_train import make_engine  # noqa: E402

OUT = ""
"""The report directory, ``sys.argv[1]`` (set by ``main``: importing this module reads no arguments)."""


def report(check: str, ok: bool, detail: object = None) -> None:
    with open(os.path.join(OUT, "report.rank0.jsonl"), "a") as f:
        f.write(json.dumps({"rank": 0, "check": check, "ok": bool(ok), "detail": detail}) + "\n")


def check(name: str):
    def run(fn):
        try:
            result = fn()
            report(name, result is None or result is True, None if result in (None, True) else repr(result))
        except Exception as e:  # the check failed: say how
            report(name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        return fn
    return run


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


class Recorder(internals.checkpoint_engine_base()):
    """Records what DeepSpeed asks of a checkpoint engine; saves nothing."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[str] = []

    def create(self, info):
        self.calls.append(f"create {info.tag} latest={info.save_latest}")

    def makedirs(self, path, exist_ok=False):
        self.calls.append("makedirs")

    def save(self, state_dict, path):
        self.calls.append(f"save {os.path.basename(path)}")

    def load(self, path, map_location=None):
        self.calls.append(f"load {os.path.basename(path)}")
        raise FileNotFoundError(path)

    def commit(self, info):
        self.calls.append(f"commit {info.tag}")
        return True


def internals_checks(tmp: str) -> None:
    check("version in TESTED")(lambda: internals.check_version())
    check("safe globals resolve to DeepSpeed's classes")(
        lambda: len(internals.safe_globals()) == len(internals.SAFE_GLOBALS))
    base = internals.checkpoint_engine_base()
    check("checkpoint engine interface")(lambda: (
        parameters(base.save) == ["self", "state_dict", "path"]
        and parameters(base.load) == ["self", "path", "map_location"]
        and parameters(base.commit) == ["self", "info"] and parameters(base.create) == ["self", "info"]
        and parameters(base.makedirs) == ["self", "path", "exist_ok"]
        and all(callable(getattr(base, m, None)) for m in ("preserves_storage_sharing", "is_data_parallel_writer"))
    ) or [parameters(getattr(base, m)) for m in ("save", "load", "commit", "create", "makedirs")])
    for zero in (1, 2, 3):
        engine = make_engine(zero)
        check(f"zero{zero}: default checkpoint engine is torch's")(
            lambda: internals.is_torch_checkpoint_engine(internals.get_checkpoint_engine(engine)))
        check(f"zero{zero}: sizes, stage, offload")(lambda: (
            internals.parallel_sizes(engine) == {"dp": 1, "mp": 1, "pp": 1} and internals.zero_stage(engine) == zero
            and internals.nvme_offload(engine) == [] and not internals.is_pipeline(engine)
            and not internals.has_moe(engine) and internals.universal_info_needed(engine)
        ) or (internals.parallel_sizes(engine), internals.zero_stage(engine), internals.nvme_offload(engine)))
        model = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero == 3 else "mp_rank_00_model_states.pt"
        check(f"zero{zero}: files a load reads")(lambda: internals.files_to_read(engine, "/L", "T", 1) == [
            model, "zero_pp_rank_0_mp_rank_00_optim_states.pt"] or internals.files_to_read(engine, "/L", "T", 1))
        check(f"zero{zero}: save_checkpoint and load_checkpoint take our arguments")(lambda: (
            {"save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"}
            <= set(parameters(engine.save_checkpoint)) and {"load_dir", "tag", "load_module_strict",
            "load_optimizer_states", "load_lr_scheduler_states"} <= set(parameters(engine.load_checkpoint))))
        recorder = Recorder()
        internals.set_checkpoint_engine(engine, recorder)
        save_dir = os.path.join(tmp, f"save{zero}")
        os.makedirs(save_dir)

        def save_protocol():
            engine.save_checkpoint(save_dir, tag="T", save_latest=False)
            calls, written = recorder.calls, sorted(os.listdir(save_dir))
            ok = (calls[0] == "makedirs" and calls[1] == "create T latest=False" and calls[-1] == "commit T"
                  and f"save {model}" in calls and "save zero_pp_rank_0_mp_rank_00_optim_states.pt" in calls
                  and "latest" not in written and "zero_to_fp32.py" in written)  # scripts land in save_dir
            return ok or (calls, written)

        check(f"zero{zero}: save_checkpoint's calls")(save_protocol)

        def model_states_on_every_rank():  # a rank that does not write them (dp rank > 0) made to, then restored
            engine.save_non_zero_checkpoint = False
            recorder.calls.clear()
            engine.save_checkpoint(save_dir, tag="U", save_latest=False)
            without = f"save {model}" in recorder.calls or internals.writes_model_states(engine)
            recorder.calls.clear()
            with internals.model_states_on_every_rank(engine):
                engine.save_checkpoint(save_dir, tag="V", save_latest=False)
            restored = internals.writes_model_states(engine) is False
            engine.save_non_zero_checkpoint = True
            return (not without and f"save {model}" in recorder.calls and restored) or (without, recorder.calls)

        check(f"zero{zero}: model states file on every rank")(model_states_on_every_rank)

        def needs_stand_ins():  # the model files are found with glob: without files there, nothing is read
            recorder.calls.clear()
            try:
                engine.load_checkpoint(os.path.join(tmp, "empty"), tag="T")
            except AssertionError:  # DeepSpeed's "no checkpoint files" (an empty glob)
                return recorder.calls == [] or recorder.calls
            return "loaded without files"

        check(f"zero{zero}: load_checkpoint lists model files with glob")(needs_stand_ins)
        engine.destroy()


def refusals() -> None:
    engine = make_engine(2)

    def refused(what: str, setup, expect: str) -> None:
        def run():
            undo = setup()
            try:
                DeepSpeedState(engine)
            except ConfigError as e:
                return (expect in str(e) and "HINT" in str(e)) or str(e)
            finally:
                undo()
            return "accepted"
        check(f"refuses {what}")(run)

    class Offload:
        def __init__(self, device: str) -> None:
            self.device = device

    def patch(attr: str, value):
        def setup():
            setattr(engine, attr, lambda: value)
            return lambda: delattr(engine, attr)
        return setup

    refused("optimizer offload to NVMe", patch("zero_offload_optimizer", Offload("nvme")), "offload_optimizer")
    refused("parameter offload to NVMe", patch("zero_offload_param", Offload("nvme")), "offload_param")

    class OtherWriter(internals.checkpoint_engine_base()):
        create = save = load = commit = lambda *a, **k: None

    def other_writer():
        original = internals.get_checkpoint_engine(engine)
        internals.set_checkpoint_engine(engine, OtherWriter())
        return lambda: internals.set_checkpoint_engine(engine, original)

    refused("another checkpoint writer", other_writer, "OtherWriter")
    check("accepts offload to CPU")(lambda: isinstance(DeepSpeedState(engine), DeepSpeedState))


def two_engines(tmp: str) -> None:
    """Two engines in one state: each one's files prefixed by its key; both come back. The same prefix twice
    is an error naming the file."""
    from tests.deepspeed.ds_train import fingerprint, train_step

    a, b = make_engine(2), make_engine(1, seed=5)
    for step in (1, 2):
        train_step(a, step)
        train_step(b, step)
    url = os.path.join(tmp, "two")
    with CheckpointManager(url, announce=False) as ckpt:
        ckpt.save(2, {"a": a, "b": b}, block=True)
        files = sorted(ckpt.engine.storage.entries("step_000000000002"))
    want = {"a": fingerprint(a), "b": fingerprint(b)}
    fresh = {"a": make_engine(2, seed=7), "b": make_engine(1, seed=8)}
    with CheckpointManager(url, announce=False) as ckpt:
        step = ckpt.resume(fresh)
    got = {k: fingerprint(e) for k, e in fresh.items()}
    expected = {f"{key}.{name}" for key in "ab"
                for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")}
    check("two engines: files prefixed by key")(lambda: expected <= set(files) or files)
    check("two engines: both resumed")(lambda: step == 2 and all(
        set(got[k]) == set(want[k]) and all(torch.equal(got[k][n], want[k][n]) for n in want[k]) for k in want))

    def same_prefix():
        with CheckpointManager(os.path.join(tmp, "clash"), announce=False) as ckpt:
            try:
                ckpt.save(1, {"a": DeepSpeedState(a), "b": DeepSpeedState(b)})
            except ConfigError as e:
                return "stages a file named 'mp_rank_00_model_states.pt'" in str(e) or str(e)
        return "saved"

    check("two engines: the same file name twice is refused")(same_prefix)


def dp_change(directory: str) -> None:
    engine = make_engine(2)

    def run():
        with CheckpointManager(directory, announce=False) as ckpt:
            try:
                ckpt.resume({"engine": engine})
            except StateMismatchError as e:
                return ("saved on 2 data-parallel ranks" in str(e) and "ds_to_universal" in str(e)) or str(e)
        return "resumed"

    check("refuses another data-parallel size")(run)


def universal(directory: str) -> None:
    """Load a ds_to_universal conversion (``DIR/universal``) on 1 rank with DeepSpeed's own load_universal."""
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(directory, tag="universal")
    want = torch.load(os.path.join(directory, "final_rank0.pt"), weights_only=True)["full"]
    got = {n: p.detach() for n, p in engine.module.named_parameters()}
    check("a ds_to_universal conversion of a 2-rank step loads on 1 rank")(
        lambda: all(torch.equal(got[n], w) for n, w in want.items()))


def main() -> None:
    global OUT
    OUT = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[2]
    if what == "internals":
        internals_checks(OUT)
    elif what == "refusals":
        refusals()
        two_engines(OUT)
    elif what == "dp-change":
        dp_change(sys.argv[3])
    elif what == "universal":
        universal(sys.argv[3])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
