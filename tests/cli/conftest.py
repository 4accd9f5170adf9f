"""Fixtures for the CLI tests: real training jobs (one killed mid-save and resumed) and the real CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import logging
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from typing import Any

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 180  # one training process, on a shared 2-core machine
HANG_AT, INTERVAL, STEPS = 30, 10, 40


def cli(*args: Any, env: dict[str, str | None] | None = None, timeout: float | None = None,
        process: bool = False) -> subprocess.CompletedProcess:
    """Run the ``ft-checkpoint`` command line (``env`` values of None unset): its ``main`` in this process, its output
    and exit code captured, or with ``process`` the real console entry point as a subprocess; so too with a
    ``timeout``, the guard of a test about a hang (a FIFO, say), which a call in this process could not end.

    In this process by default: a subprocess imports torch for ``verify`` and ``gc`` (the rank files), 2-4 s a call on
    a loaded 2-core machine, and the CLI tests make over a hundred calls. ``main`` is what the console script calls;
    ``test_python_m_ft_checkpoint_runs_the_cli``, the examples' tests and the ``LIVE_JOB`` race run the real entry
    point."""
    cmd = [sys.executable, "-m", "ft_checkpoint.tools.cli", *map(str, args)]
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    if process or timeout is not None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or 120, cwd=ROOT, env=full)
    return _in_this_process(cmd, full)


def _in_this_process(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``main`` as a new process would run it: ``env`` as its environment, no variable warned about yet; what the
    call changed of the process (environment, warnings given, log handlers) is put back after it."""
    from ft_checkpoint import config
    from ft_checkpoint.format import layout
    from ft_checkpoint.tools.cli import main

    before, handlers = dict(os.environ), list(logging.getLogger("ft_checkpoint").handlers)
    once = (config._warned_env, layout._WARNED, layout._NOT_COUNTED, layout._LEFT_OUT,  # the warnings a process
            layout._UNREPORTED)  # gives once, and those of steps that do not count it left out
    warned = [set(given) for given in once]
    for given in once:
        given.clear()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(cmd[3:])
            except SystemExit as e:  # argparse: a usage error (2), --help or --version (0)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        os.environ.clear()
        os.environ.update(before)
        logging.getLogger("ft_checkpoint").handlers[:] = handlers  # main's stderr handler: for this call only
        for given, kept in zip(once, warned):
            given.clear()
            given.update(kept)
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())


def cli_json(*args: Any, env: dict[str, str] | None = None, rc: int = 0, process: bool = False) -> Any:
    """``cli(..., "--json")``, checking the exit code; returns the parsed output."""
    proc = cli(*args, "--json", env=env, process=process)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def open_terminal() -> tuple[int, int]:
    """A pseudo-terminal 150 columns wide (a new one has 0, where tqdm draws nothing): ``(leader, follower)``."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    return leader, follower


def drawn(leader: int) -> str:
    """Everything written to the terminal of ``leader`` until its follower closed; closes ``leader``."""
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal closed
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return out.decode(errors="replace")


def run_in_terminal(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal; its exit code and what it drew."""
    leader, follower = open_terminal()
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, cwd=ROOT, env={**os.environ, **(env or {})})
    os.close(follower)
    text = drawn(leader)
    return proc.wait(timeout=TIMEOUT), text


@dataclasses.dataclass
class Run:
    """A checkpoint directory written by a job that was killed mid-save at ``killed_at`` and resumed."""

    url: str
    env: dict[str, str]
    killed_at: int
    resumed_from: int
    ls_between: dict[str, Any]
    """``ls --json`` between the killed attempt and the resumed one."""
    ls_between_text: str


def _train(url: str, env: dict[str, str], *args: Any, hang: bool = False) -> list[str]:
    """Run one attempt of the training; with ``hang``, SIGKILL it once it hangs in the save of HANG_AT."""
    cmd = [sys.executable, SCRIPT, url, "--steps", str(STEPS), "--interval", str(INTERVAL), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **env})
    watchdog = threading.Timer(TIMEOUT, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if hang and line.startswith("HANG"):
                time.sleep(0.5)  # let its journal's progress note land, as it would during any real hang
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait()
    finally:
        watchdog.cancel()
    expected = -signal.SIGKILL if hang else 0
    assert proc.returncode == expected, "\n".join(lines)
    return lines


def killed_and_resumed(url: str, env: dict[str, str]) -> Run:
    """Train, hang in the save of step HANG_AT and be SIGKILLed there; list the directory; resume to the end."""
    _train(url, env, "--hang-at", HANG_AT, hang=True)
    ls_between = cli_json("ls", url, env=env)
    ls_text = cli("ls", url, env=env).stdout
    lines = _train(url, env)
    resumed_from = int(next(line for line in lines if line.startswith("START")).split()[1])
    return Run(url, env, HANG_AT, resumed_from, ls_between, ls_text)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Run:
    return killed_and_resumed(str(tmp_path_factory.mktemp("cli") / "run"), {})
