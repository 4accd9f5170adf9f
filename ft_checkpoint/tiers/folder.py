"""A node's fast-tier folder: a folder per run, and in it a checkpoint directory per rank whose files it holds.

::

    <fast_dirpath>/
      run-3f9c2a1b7d004e11/          one run: its key hashes the durable dirpath and the launcher's run id
        owner.json                   the run's durable dirpath, host and the pids of its ranks on this node
        rank_00002/                  rank 2's files: a single-process checkpoint directory (see ``layout``)
          committed.json             the newest step committed for the whole job (written once every rank of
                                     the job wrote its files and its peer copy, and all agreed), and which
                                     save wrote it (a step saved again after a resume is another save)
          step_000000000120/         manifest.json, metadata.json, __0_0.distcp, rank_00000.pt
          step_000000000125/         the step being written (or one a crash left: not committed)

Each rank's folder holds what a single-process checkpoint of that rank's local state holds, so the durable
tier's code writes, checks, loads and deletes it, and ``ft-checkpoint inspect`` shows it. A node's own ranks
and the peer copies it keeps look the same. Retention keeps the committed step and the one being written.
Another run's folder is never read; it is removed once its owner is gone (same host, none of its pids alive).

Example:
    >>> import tempfile
    >>> folder = FastFolder(tempfile.mkdtemp(), run_key("gs://b/run", "TORCHELASTIC_RUN_ID=job1"))
    >>> folder.commit(3, step=120, world_size=4, save="a1b2")
    >>> folder.committed(3)
    Mark(step=120, world_size=4, save='a1b2')
    >>> folder.held_ranks()
    [3]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import time
from typing import Any

from ft_checkpoint.format import layout
from ft_checkpoint.run.lease import _pid_alive as pid_alive
from ft_checkpoint.store import jsonfile
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
OWNER = "owner.json"
COMMITTED = "committed.json"
_RUN_RE = re.compile(r"run-[0-9a-f]{16}", re.ASCII)
_RANK_RE = re.compile(r"rank_([0-9]{5})", re.ASCII)


def run_key(durable_url: str, job: str | None) -> str:
    """The folder name of one run: a hash of the durable dirpath and the launcher's run id (``lease.job_id``).

    Example:
        >>> run_key("gs://b/run", "SLURM_JOB_ID=7") == run_key("gs://b/run", "SLURM_JOB_ID=8")
        False
    """
    return "run-" + hashlib.sha256(f"{durable_url}\n{job or ''}".encode()).hexdigest()[:16]


def rank_dir(rank: int) -> str:
    """The folder of rank ``rank``'s files."""
    return f"rank_{rank:05d}"


@dataclasses.dataclass(frozen=True)
class Mark:
    """What ``committed.json`` says: the newest step committed for the job, the job's world size then, and the save
    that wrote it (every part of it carries the same; see ``write``)."""

    step: int
    world_size: int
    save: str = ""


class FastFolder:
    """One run's folder in a node's fast tier (see the module's docstring)."""

    def __init__(self, fast_dirpath: str, key: str) -> None:
        self.key = key
        self.root = os.path.join(os.path.abspath(fast_dirpath), key)
        self._storages: dict[int, Storage] = {}

    def storage(self, rank: int) -> Storage:
        """Rank ``rank``'s checkpoint directory here (written without fsync: see ``Storage``)."""
        if rank not in self._storages:
            self._storages[rank] = Storage(os.path.join(self.root, rank_dir(rank)), retries=1, fsync=False)
        return self._storages[rank]

    def held_ranks(self) -> list[int]:
        """The ranks that have a folder here (real directories only)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for e in entries if (m := _RANK_RE.fullmatch(e.name))
                      and e.is_dir(follow_symlinks=False))

    def committed(self, rank: int) -> Mark | None:
        """The step ``committed.json`` of rank ``rank`` names (None if none, or unreadable: logged)."""
        path = os.path.join(self.root, rank_dir(rank), COMMITTED)
        try:
            with open(path, "rb") as f:
                body = jsonfile.load_object(f.read(jsonfile.MAX_BYTES + 1))
            return Mark(step=jsonfile.get_int(body, "step", minimum=0, maximum=layout.MAX_STEP - 1),  # type: ignore[arg-type]
                        world_size=jsonfile.get_int(body, "world_size", minimum=1),  # type: ignore[arg-type]
                        save=jsonfile.get_str(body, "save", optional=True) or "")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", path, e)
            return None

    def commit(self, rank: int, *, step: int, world_size: int, save: str) -> None:
        """Record ``step`` (written by the save ``save``) as rank ``rank``'s newest committed step here (atomically)."""
        body = {"format": "ft-checkpoint-fast-tier", "step": step, "world_size": world_size, "save": save,
                "time": time.time()}
        self.storage(rank).write_bytes(COMMITTED, json.dumps(body).encode())

    def retain(self, rank: int, keep: set[int]) -> None:
        """Delete rank ``rank``'s steps here except those in ``keep``."""
        storage = self.storage(rank)
        for step in sorted(set(layout.list_steps(storage)) - keep):
            layout.delete_step(storage, step)

    def remove(self, rank: int) -> None:
        """Delete everything of rank ``rank`` here (its steps, its mark, its folder)."""
        self.retain(rank, set())
        storage = self.storage(rank)
        storage.delete_file(COMMITTED)
        storage.delete_empty_dir("")

    def write_owner(self, durable_url: str, pids: list[int]) -> None:
        """Record who owns this folder: the run's durable dirpath, this host, its ranks' pids here."""
        os.makedirs(self.root, exist_ok=True)
        body = {"durable": durable_url, "host": socket.gethostname(), "pids": pids, "time": time.time()}
        Storage(self.root, retries=1, fsync=False).write_bytes(OWNER, json.dumps(body).encode())

    def owner(self) -> dict[str, Any] | None:
        """What ``owner.json`` says (None if it is missing or unreadable)."""
        try:
            with open(os.path.join(self.root, OWNER), "rb") as f:
                return jsonfile.load_object(f.read(jsonfile.MAX_BYTES + 1))
        except (OSError, ValueError):
            return None

    def remove_all(self) -> None:
        """Delete the whole folder: every rank's files, then the owner file (anything else is left, with a warning)."""
        for rank in self.held_ranks():
            self.remove(rank)
        try:
            os.remove(os.path.join(self.root, OWNER))
            os.rmdir(self.root)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("left %s in place: %s", self.root, e)


def runs_in(fast_dirpath: str) -> list[FastFolder]:
    """Every run's folder in a fast tier (real directories named like one)."""
    try:
        entries = list(os.scandir(fast_dirpath))
    except FileNotFoundError:
        return []
    return [FastFolder(fast_dirpath, e.name) for e in sorted(entries, key=lambda e: e.name)
            if _RUN_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def clean_other_runs(fast_dirpath: str, key: str) -> list[str]:
    """Remove the folders of other runs whose owner is gone (this host, no pid of theirs alive); their paths.

    A folder of a run on another host (a shared disk), or whose owner may be alive, is left alone."""
    removed = []
    for folder in runs_in(fast_dirpath):
        owner = folder.owner()
        if folder.key == key or owner is None or owner.get("host") != socket.gethostname():
            continue
        pids = owner.get("pids")
        if not isinstance(pids, list) or any(not jsonfile.is_int(p) or (0 < p < 2**31 and pid_alive(p)) for p in pids):
            continue
        folder.remove_all()
        removed.append(folder.root)
    return removed
