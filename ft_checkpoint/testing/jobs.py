"""Test support: run a training script as a real job (one process, ``torchrun`` or ``accelerate launch``)
and read what its ranks reported.

A script reports with :func:`report`: one JSON object per line in ``OUT/report.rank<R>.jsonl`` (``R`` from
``RANK``), appended, so that a rank restarted by its launcher adds to what it reported before. :func:`run`
returns a :class:`Finished` job whose :attr:`~Finished.rows` are the objects reported during that run only;
:func:`start` returns a running one, for tests that act on what it prints while it runs.

Example:
    >>> import os, sys, tempfile
    >>> out = tempfile.mkdtemp()
    >>> script = os.path.join(out, "train.py")
    >>> with open(script, "w") as f:
    ...     _ = f.write("import sys\\nfrom ft_checkpoint.testing.jobs import report\\n"
    ...                 "report(sys.argv[1], step=3, loss=0.5)\\n")
    >>> job = run(script, out, out=out).expect(0)
    >>> job.where(step=3)
    [{'rank': 0, 'step': 3, 'loss': 0.5}]
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from ft_checkpoint.testing.servers import _wait_for_port, free_port

LAUNCHERS = ("python", "torchrun", "accelerate")


def report(out: str, **fields: Any) -> None:
    """Append ``{"rank": RANK, **fields}`` to ``OUT/report.rank<RANK>.jsonl`` (from inside a job's script)."""
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"report.rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"rank": rank, **fields}) + "\n")


@dataclasses.dataclass
class Finished:
    """A finished job: its command, exit code and output, and what its ranks reported during the run."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    out: str | None = None
    _offsets: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every object reported during this run, rank by rank, in order."""
        rows: list[dict[str, Any]] = []
        for path in _report_files(self.out):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                rows += [json.loads(line) for line in f if line.strip()]
        return rows

    def where(self, **match: Any) -> list[dict[str, Any]]:
        """The rows that have every key of ``match`` with that value."""
        return [r for r in self.rows if all(k in r and r[k] == v for k, v in match.items())]

    def explain(self) -> str:
        return (f"{' '.join(self.cmd)}\nexit {self.returncode}\n--- stdout ---\n{self.stdout[-6000:]}\n"
                f"--- stderr ---\n{self.stderr[-8000:]}")

    def expect(self, returncode: int = 0) -> Finished:
        """Assert the exit code (``-9``: the job SIGKILLed itself), with the output in the message."""
        assert self.returncode == returncode, f"expected exit {returncode}:\n{self.explain()}"
        return self


def command(script: str, *args: Any, launcher: str = "python", nproc: int = 1, restarts: int = 0,
            launcher_args: list[str] | None = None) -> list[str]:
    """The command line of a job: ``python script``, or the script under ``torchrun`` or ``accelerate launch``
    with ``nproc`` ranks and ``restarts`` launcher restarts, on a c10d rendezvous of its own.
    ``launcher_args`` go to the launcher (``["--multi_gpu"]``, ``["--use_deepspeed", "--zero_stage", "2"]``), or
    to the interpreter for ``launcher="python"`` (``["-X", "faulthandler"]``), which runs one process and
    ignores ``nproc`` and ``restarts`` (a test may pass them for either launcher).

    Example:
        >>> command("train.py", 3, launcher_args=["-X", "faulthandler"])[1:]
        ['-X', 'faulthandler', 'train.py', '3']
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: expected one of {LAUNCHERS}")
    tail = [*(launcher_args or []), script, *map(str, args)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
                str(restarts), "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{free_port()}", *tail]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--max_restarts",
                str(restarts), "--rdzv_backend", "c10d", "--main_process_port", str(free_port()), *tail]
    return [sys.executable, *tail]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without ``FT_CHECKPOINT_*`` settings, one thread per rank, unbuffered output, Python
    stacks printed on a fatal signal (a job that times out is aborted with one) and an unshared rendezvous store
    (launcher restarts are reliable with it) on a free port, plus ``extra``.

    The port: ``accelerate launch`` on one machine passes no rendezvous endpoint to torchrun, whose c10d
    rendezvous then listens on port 29400, so that two jobs running at once (tests on several workers) join
    each other's rendezvous; torchrun reads its default endpoint from ``PET_RDZV_ENDPOINT``.

    Two savings on the suite's hundreds of jobs: their modules' bytecode is written (``PYTHONDONTWRITEBYTECODE``
    dropped: this package's modules are compiled once, not in every process, 0.15 s a process), and ``transformers``,
    if installed, is hidden from the jobs' package metadata (:func:`metadata_without_transformers`) unless
    ``extra`` sets ``FT_TEST_TRANSFORMERS=1``: torchmetrics imports it with Lightning whenever its metadata says
    it is installed, a quarter of a Lightning process's start (0.9 s); the test environment has it for one
    purpose, Accelerate's DeepSpeed plugin, whose jobs ask for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_CHECKPOINT_") and
           k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"})
    env.update(extra or {})
    if env.get("FT_TEST_TRANSFORMERS") != "1":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [metadata_without_transformers(), env.get("PYTHONPATH")]))
    return env


@functools.cache
def metadata_without_transformers() -> str:
    """A folder to put first on a job's ``PYTHONPATH`` that makes ``importlib.metadata`` report ``transformers``
    at version 0.0.0, so that libraries that import it only when a usable version is installed (torchmetrics,
    which Lightning imports) leave it out, as in an environment without it. Created once per process."""
    folder = tempfile.mkdtemp(prefix="ft-test-metadata-")
    atexit.register(shutil.rmtree, folder, True)
    os.makedirs(os.path.join(folder, "transformers-0.0.0.dist-info"))
    with open(os.path.join(folder, "transformers-0.0.0.dist-info", "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: transformers\nVersion: 0.0.0\n")
    return folder


def run(script: str, *args: Any, out: Any = None, launcher: str = "python", nproc: int = 1, restarts: int = 0,
        launcher_args: list[str] | None = None, env: dict[str, str] | None = None, timeout: float = 600,
        new_session: bool = False) -> Finished:
    """Run a job to its end (see :func:`command`, :func:`job_env`); ``out`` is where its ranks report.

    ``new_session``: the job gets a process group of its own, so that a SIGKILL it sends to its group takes
    all its ranks (and nothing of the test's).
    """
    out = None if out is None else str(out)
    offsets = {path: os.path.getsize(path) for path in _report_files(out)}
    cmd = command(script, *args, launcher=launcher, nproc=nproc, restarts=restarts, launcher_args=launcher_args)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(env),
                          start_new_session=new_session) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(_timed_out(proc, timeout)) from None
    return Finished(cmd, proc.returncode, stdout, stderr, out, offsets)


def _timed_out(proc: subprocess.Popen[str], timeout: float) -> str:
    """Abort a job that ran past ``timeout`` and every process it started (each Python one prints its threads'
    stacks first: ``PYTHONFAULTHANDLER``), then kill what is left; returns what happened, with the stacks."""
    import signal

    import psutil  # in the test extra

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    alive = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            alive.append(f"{p.pid} {p.name()}")
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        time.sleep(2)
    try:
        stdout, stderr = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # a process outside the tree (an orphan) holds the output open
        proc.kill()
        stdout, stderr = "", "(the output stayed open: a process that left the job's tree holds it)"
    return (f"the job ran past {timeout:.0f} s: {proc.args!r}\nstill running: {alive or 'only orphans'}\n"
            f"last output:\n{(stdout or '')[-2000:]}{(stderr or '')[-8000:]}")


def start(script: str, *args: Any, launcher: str = "python", nproc: int = 1, restarts: int = 0,
          launcher_args: list[str] | None = None, env: dict[str, str] | None = None,
          stderr: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """Start a job (as :func:`run` does) and return it running, its stdout a text pipe: for tests that act
    on what it prints while it runs (send a signal at a step, SIGKILL it inside a phase of a save).
    ``stderr=subprocess.STDOUT`` merges its errors into that pipe."""
    cmd = command(script, *args, launcher=launcher, nproc=nproc, restarts=restarts, launcher_args=launcher_args)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=job_env(env))


def run_nodes(script: str, *args: Any, out: Any, nodes: list[dict[str, str]], nproc: int = 2, restarts: int = 0,
              timeout: float = 600) -> Finished:
    """Run a job of ``len(nodes)`` "nodes" on this machine: one torchrun agent per node, each with ``nproc`` ranks,
    all on one c10d rendezvous (its run id names the job: ``TORCHELASTIC_RUN_ID``); agent ``i`` runs with the
    environment ``nodes[i]`` added (its own fast-tier folder, its name). The first agent starts first and hosts
    the rendezvous, so that losing another agent leaves it in place. The result's exit code is the worst of the
    agents', its output theirs, each line prefixed with ``[node i]``.

    Example:
        >>> run_nodes("train.py", out="/tmp/o", nodes=[{}, {}], timeout=0.1)  # doctest: +SKIP
    """
    out = str(out)
    offsets = {path: os.path.getsize(path) for path in _report_files(out)}
    port, run_id = free_port(), f"job-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", run_id, script, *map(str, args)]
    agents: list[subprocess.Popen] = []
    try:
        for extra in nodes:
            agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env=job_env(extra)))
            if len(agents) == 1:
                _wait_for_port(port, agents[0], timeout=120)
        outputs = [agent.communicate(timeout=timeout) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    label = lambda i, text: "".join(f"[node {i}] {line}\n" for line in text.splitlines())  # noqa: E731
    codes = [agent.returncode for agent in agents]
    return Finished(cmd, max(codes, key=abs), "".join(label(i, o) for i, (o, _) in enumerate(outputs)),
                    "".join(label(i, e) for i, (_, e) in enumerate(outputs)), out, offsets)


def _report_files(out: str | None) -> list[str]:
    return sorted(glob.glob(os.path.join(out, "report.rank*.jsonl"))) if out else []
