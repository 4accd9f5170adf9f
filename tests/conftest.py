"""Shared fixtures: real storage servers and one ``backend`` fixture per storage kind."""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from typing import Any

import pytest

import ft_checkpoint.testing.faults  # noqa: F401 - registers faulty:// for the tests (a user's install has none)
from ft_checkpoint import manager
from ft_checkpoint.format import layout
from ft_checkpoint.testing import servers


def pytest_ignore_collect(collection_path, config):
    """Only ``test_*.py`` and ``conftest.py`` are collected below ``tests/``.

    ``--doctest-modules`` would otherwise import every script here (training scripts that read ``sys.argv``,
    DeepSpeed's, which import ``deepspeed`` into the process that runs every other test); they hold no doctests.
    """
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """The files that hold a ``slow`` test (jobs killed and restarted: a minute or more each) run first, the quick
    ones after them. With ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml) each worker takes the next
    file in this order, so that the hundreds of quick files fill the end of the run. xdist's own order (most tests
    first) puts the longest files, which hold few tests each, last, where one of them can keep a worker busy after
    the other has run out of files."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: the order within each part is kept


class _Forgotten(set):
    """Keeps nothing: see :func:`each_manager_as_if_in_a_new_process`."""

    def add(self, item: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def each_manager_as_if_in_a_new_process(monkeypatch):
    """Tests restart a job in their own process where a user's job would start a new one: the directories an earlier
    manager of this process saved to (a resume from one warns) are not kept, except where a test asks for them
    (``tests/core/test_careless_calls.py``)."""
    monkeypatch.setattr(manager, "_saved_by_this_process", _Forgotten())


@pytest.fixture(autouse=True)
def warnings_of_steps_that_do_not_count_as_if_in_a_new_process(monkeypatch):
    """A process warns of at most ``layout.MAX_NOT_COUNTED_WARNINGS`` steps that do not count as committed: each test
    has them all, as a new process would, whatever tests this worker ran before it."""
    for name in ("_NOT_COUNTED", "_LEFT_OUT", "_UNREPORTED"):
        monkeypatch.setattr(layout, name, set())


@pytest.fixture
def short_wait_after_takeover(monkeypatch):
    """A job that takes over a lease whose owner may be alive waits 30 s (:attr:`Lease.recent`) before its first save;
    here 0.5 s: for the tests about what leads to a takeover, not about that wait (``tests/core/test_lease.py``)."""
    from ft_checkpoint.run.lease import Lease

    monkeypatch.setattr(Lease, "recent", property(lambda self: 0.5))


@pytest.fixture(scope="session")
def gcs_server():
    server = servers.start("gcs")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    server = servers.start("s3")
    yield server
    server.stop()


@dataclasses.dataclass
class Backend:
    """A fresh checkpoint directory on one storage kind."""

    name: str
    url: str
    storage_options: dict[str, Any]
    server: servers.Server | None = None

    def env(self) -> dict[str, str]:
        """This process's environment, with what a subprocess needs to reach the backend's server (if any)."""
        return {**os.environ, **(self.server.env() if self.server else {})}


def _make_backend(name: str, request: pytest.FixtureRequest, tmp_path) -> Backend:
    run = f"run-{uuid.uuid4().hex[:8]}"
    if name == "local":
        return Backend(name, str(tmp_path / run), {})
    if name == "memory":
        return Backend(name, f"memory://{run}", {})
    server = request.getfixturevalue(f"{name}_server")
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    server.make_bucket(bucket)
    return Backend(name, f"{server.protocol}://{bucket}/{run}", server.storage_options, server)


BACKENDS = ["local", "memory", "gcs", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Backend:
    """Each test using it runs once per storage kind: local disk, memory://, GCS emulator, S3 server."""
    return _make_backend(request.param, request, tmp_path)


@pytest.fixture
def local_backend(request, tmp_path) -> Backend:
    return _make_backend("local", request, tmp_path)


@pytest.fixture
def python() -> str:
    return sys.executable
