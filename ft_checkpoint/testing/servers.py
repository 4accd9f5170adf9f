"""Real storage servers for tests: the GCS emulator and moto's S3 server, on 127.0.0.1.

Each server is a real subprocess on a free port; ``start`` waits until the port answers, ``stop``
kills it by pid. The fixtures in ``conftest.py`` start one of each per test session.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

# gcsfs otherwise asks every bucket for its type over gRPC, which the emulator cannot answer (60 s each).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up), so that no client connection takes it
    as its source port while a stopped server waits to be restarted on it."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {proc.args!r} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not answer within {timeout} s")


def _bin(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed: pip install 'ft-checkpoint[test]'")
    return found


@dataclasses.dataclass
class Server:
    """One running storage server and how to reach a bucket on it."""

    kind: str
    port: int
    proc: subprocess.Popen

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        if self.kind == "gcs":
            return {"endpoint_url": self.endpoint, "token": "anon"}
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    @property
    def protocol(self) -> str:
        return "gs" if self.kind == "gcs" else "s3"

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that only sees env vars (AWS/GCS client defaults)."""
        if self.kind == "gcs":
            return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self, name: str) -> None:
        import fsspec

        fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)
        fs.mkdir(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


IDLE_TIMEOUT = 20
"""Seconds the GCS emulator keeps an idle connection open (see :mod:`ft_checkpoint.testing.gcs_emulator`)."""


def start(kind: str, *, port: int | None = None, data_dir: str | None = None) -> Server:
    """Start a ``"gcs"`` or ``"s3"`` server and wait until it answers.

    With ``data_dir`` the GCS emulator keeps its objects on disk there, so a restart finds them again.
    """
    port = port or free_port()
    if kind == "gcs":
        emulator = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator.py")  # a script: no install
        cmd = [sys.executable, emulator, "--idle-timeout", str(IDLE_TIMEOUT), "start", "--host", "127.0.0.1", "--port",
               str(port)]
        cmd += [] if data_dir else ["--in-memory"]
    elif kind == "s3":
        cmd = [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    else:
        raise ValueError(kind)
    # A restart on the port of a stopped server can find the port briefly taken (by TIME_WAIT, or as the
    # source port of another client's connection): the server then exits at once, and we try again.
    deadline = time.monotonic() + 30.0
    while True:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=data_dir)
        try:
            _wait_for_port(port, proc)
            break
        except Exception:
            proc.kill()
            proc.wait(timeout=10)
            if proc.returncode in (None, -9) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    return Server(kind, port, proc)
