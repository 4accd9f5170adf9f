"""A node's fast-tier folder: a folder per run, and in it a checkpoint directory per rank whose files it holds.

::

    <fast_dirpath>/
      run-3f9c2a1b7d004e11/          one run: its key hashes the durable dirpath, the launcher's run id and
                                     the oldest attempt of its journal (see ``run_key``)
        owner.json                   the run's durable dirpath, host, the pids of its ranks on this node (and of
                                     torchrun's agent, which restarts them), and the name of this start
        rank_00002/                  rank 2's files: a single-process checkpoint directory (see ``layout``)
          committed.json             the newest step committed for the whole job (written once every rank of
                                     the job wrote its files and its peer copy, and all agreed), and which
                                     save wrote it (a step saved again after a resume is another save)
          step_000000000120/         manifest.json, metadata.json, __0_0.distcp, rank_00000.pt
          step_000000000125/         the step being written (or one a crash left: not committed)

Each rank's folder holds what a single-process checkpoint of that rank's local state holds, so the durable
tier's code writes, checks, loads and deletes it, and ``ft-checkpoint inspect`` shows it. A node's own ranks
and the peer copies it keeps look the same. Retention keeps the committed step and the one being written.
Another run's folder is never read; it is removed once its owner is gone: same host, none of its pids alive (under
torchrun its agent's too: a job whose ranks died keeps its folder while the agent restarts them or waits for its
nodes to join again), and no process holds the shared lock on its ``in_use.lock`` that each of the run's processes
on the node takes at its start (:meth:`FastFolder.claim`) and the kernel drops at its end, however it ends. Pids
alone are not enough: a job in another PID namespace (a container sharing ``/dev/shm`` and the host name) has pids
that name no process here.

``fast_dirpath`` is often shared by the users of a node (``/dev/shm``), and a run's key can be computed by any
of them. A run's folder is used only if it is this user's own (:meth:`FastFolder.claim`): else a link in it, or
in its place, would make the job write into, then delete, whatever directory of this user's it points to.

Example:
    >>> import tempfile
    >>> folder = FastFolder(tempfile.mkdtemp(), run_key("gs://b/run", "TORCHELASTIC_RUN_ID=job1", "a"))
    >>> folder.commit(3, step=120, world_size=4, save="a1b2")
    >>> folder.committed(3)
    Mark(step=120, world_size=4, save='a1b2')
    >>> folder.held_ranks()
    [3]
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import pwd
import re
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

from ft_checkpoint.format import layout
from ft_checkpoint.run.lease import _pid_alive as pid_alive
from ft_checkpoint.store import jsonfile, nofollow
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
OWNER = "owner.json"
COMMITTED = "committed.json"
IN_USE = "in_use.lock"
_LOCK_OPEN = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""How a process opens ``in_use.lock`` to hold it: read-only (a lock needs no more; a file open to write would keep
its filesystem from being remounted read-only)."""
_RUN_RE = re.compile(r"run-[0-9a-f]{16}", re.ASCII)
_RANK_RE = re.compile(r"rank_([0-9]{5})", re.ASCII)


def run_key(durable_url: str, job: str | None, lineage: str) -> str:
    """The folder name of one run: a hash of the durable dirpath, the launcher's run id (``lease.job_id``) and the
    oldest attempt the durable directory's journal records (``journal.first_attempt``; this start's own attempt in
    a new or emptied directory): a run started over in a directory emptied with ``rm -rf`` has another key, so the
    parts of the deleted run, on a node away when it started, are another run's.

    Example:
        >>> run_key("gs://b/run", "SLURM_JOB_ID=7", "a") == run_key("gs://b/run", "SLURM_JOB_ID=8", "a")
        False
        >>> run_key("gs://b/run", None, "20261128T000000.000000Z-def456") == run_key("gs://b/run", None, "b")
        False
    """
    return "run-" + hashlib.sha256(f"{durable_url}\n{job or ''}\n{lineage}".encode()).hexdigest()[:16]


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
        self.fast_dirpath = os.path.abspath(fast_dirpath)
        self.root = os.path.join(self.fast_dirpath, key)
        self._storages: dict[int, Storage] = {}
        self._in_use: int | None = None
        """The descriptor of ``in_use.lock`` this process holds a shared lock on, from ``claim`` to ``release``."""

    def claim(self) -> str | None:
        """Create this folder, for this user only (mode 700), or check the one there; None if it may be used, else
        why not and what to do. It may be used if it is a real directory of this user that no one else can
        write, each rank's folder in it is one of this user's, and ``fast_dirpath`` lets no one else replace it
        (it is this user's or root's, and has the sticky bit, as ``/dev/shm``, if others may write it; so is every
        folder on its way, and no link of another user's leads there). ``fast_dirpath`` is resolved here, once: a
        link of the user's on its way is not followed again (pointed elsewhere later, it does not move the tier).

        Example:
            >>> import tempfile
            >>> folder = FastFolder(tempfile.mkdtemp(), "run-0123456789abcdef")
            >>> folder.claim(), oct(os.stat(folder.root).st_mode & 0o777)
            (None, '0o700')
        """
        for _ in range(3):  # again if another run removed the folder, found unused, while this start waited
            try:
                os.makedirs(self.fast_dirpath, 0o700, exist_ok=True)
                given, self.fast_dirpath = self.fast_dirpath, os.path.realpath(self.fast_dirpath)
                self.root = os.path.join(self.fast_dirpath, self.key)  # a link on the way is followed this once
                if (problem := _others_link(given) or _unsafe_path(self.fast_dirpath)) is not None:
                    return problem
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.root, 0o700)
            except OSError as e:
                return f"{self.root} cannot be created ({type(e).__name__}: {e}). HINT: {_OWN_FOLDER}"
            if (problem := self.problem()) is not None:
                return (f"{problem}, so another user could make this job write into, then delete, a directory of "
                        f"yours through a link there. HINT: remove it (its owner or root can), or {_OWN_FOLDER}")
            try:
                if self._hold():
                    return None
            except OSError as e:  # a FIFO or a link in its place: problem() looks at rank folders only
                return f"{self.root}/{IN_USE} cannot be locked ({type(e).__name__}: {e}). HINT: remove it"
        return f"{self.root} was removed three times while this job started (another run of yours cleaning it?)"

    def _hold(self) -> bool:
        """Take a shared lock on ``in_use.lock`` for as long as this process lives (or until :meth:`release`): while
        any process holds one, no other run removes this folder. False: the folder was removed meanwhile."""
        if self._in_use is not None:
            return True
        path = os.path.join(self.root, IN_USE)
        fd = os.open(path, _LOCK_OPEN, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another run checks whether this folder is in use
            held = os.fstat(fd)
            if not stat.S_ISREG(held.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(held, os.lstat(path)):
                    self._in_use, fd = fd, -1
        finally:
            if fd >= 0:
                os.close(fd)
        return self._in_use is not None

    def release(self) -> None:
        """Drop this process's lock on the folder (see :meth:`claim`); the kernel does it too when the process ends."""
        if self._in_use is not None:
            os.close(self._in_use)
            self._in_use = None

    @contextlib.contextmanager
    def unused(self) -> Iterator[bool]:
        """Whether no process holds this folder (no lock on ``in_use.lock``; a folder without one: True); while the
        ``with`` block runs, no process can take one (a start of its run waits for the block's end)."""
        try:
            fd = os.open(os.path.join(self.root, IN_USE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            yield True
            return
        except OSError:  # a link in its place, say: the folder is left alone
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def problem(self) -> str | None:
        """None if this folder is a real directory of this user that no one else can write, and each rank's folder
        in it a real directory of this user; else what is not.

        Example:
            >>> import tempfile
            >>> folder = FastFolder(tempfile.mkdtemp(), "run-0123456789abcdef")
            >>> os.mkdir(folder.root); os.chmod(folder.root, 0o777)
            >>> folder.problem().endswith("can be written by other users (mode drwxrwxrwx)")
            True
        """
        try:
            if (problem := _not_own(self.root, private=True)) is not None:
                return problem
            ranks = sorted(e.path for e in os.scandir(self.root) if _RANK_RE.fullmatch(e.name))
            return next((p for p in map(_not_own, ranks) if p is not None), None)
        except OSError as e:
            return f"{self.root} cannot be checked ({type(e).__name__}: {e})"

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
        rel = f"{rank_dir(rank)}/{COMMITTED}"
        try:
            body = _read_json(self.root, rel)
            return Mark(step=jsonfile.get_int(body, "step", minimum=0, maximum=layout.MAX_STEP - 1),  # type: ignore[arg-type]
                        world_size=jsonfile.get_int(body, "world_size", minimum=1),  # type: ignore[arg-type]
                        save=jsonfile.get_str(body, "save", optional=True) or "")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", os.path.join(self.root, rel), e)
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

    def write_owner(self, durable_url: str, pids: list[int], *, start: str = "") -> None:
        """Record who owns this folder: the run's durable dirpath, this host, its ranks' pids here, and the name of
        this start of the run (by which its other ranks on the node check that they see this folder)."""
        os.makedirs(self.root, exist_ok=True)
        body = {"durable": durable_url, "host": socket.gethostname(), "pids": pids, "time": time.time(),
                "start": start}
        Storage(self.root, retries=1, fsync=False).write_bytes(OWNER, json.dumps(body).encode())

    def owner(self) -> dict[str, Any] | None:
        """What ``owner.json`` says (None if it is missing or unreadable: a FIFO or a link in its place, say)."""
        try:
            return _read_json(self.root, OWNER)
        except (OSError, ValueError):
            return None

    def remove_all(self) -> None:
        """Delete the whole folder: every rank's files, then the owner file (anything else is left, with a warning)."""
        for rank in self.held_ranks():
            self.remove(rank)
        try:
            for name in (OWNER, IN_USE):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.root, name))
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

    A folder of a run on another host (a shared disk), whose owner may be alive, or that is not this user's own (its
    rank folders could be swapped for links while they are deleted) is left alone."""
    removed = []
    for folder in runs_in(fast_dirpath):
        if folder.key == key or folder.problem() is not None:  # another user's folder is never read
            continue
        owner = folder.owner()
        if owner is None or owner.get("host") != socket.gethostname():
            continue
        pids = owner.get("pids")
        if not isinstance(pids, list) or any(not jsonfile.is_int(p) or (0 < p < 2**31 and pid_alive(p)) for p in pids):
            continue
        with folder.unused() as unused:
            if unused:
                folder.remove_all()
                removed.append(folder.root)
    return removed


def _read_json(folder: str, rel: str) -> dict[str, Any]:
    """The JSON object in ``folder/rel``, read without following a link or waiting on a FIFO, up to a journal
    entry's cap."""
    return jsonfile.load_object(nofollow.read_regular_file(folder, rel, max_bytes=jsonfile.MAX_BYTES,
                                                           url=os.path.join(folder, rel)))


_OWN_FOLDER = "point fast_dirpath at a folder only you can write (mkdir -m 700 /dev/shm/$USER)"


def _user(uid: int) -> str:
    """``uid``'s name and number, for messages."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _not_own(path: str, *, private: bool = False) -> str | None:
    """None if ``path`` is a real directory (not a link) of this user, and with ``private`` one no one else can
    write; else what it is."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to {_user(info.st_uid)}, not to you, {_user(os.geteuid())}"
    if private and info.st_mode & 0o022:
        return f"{path} can be written by other users (mode {stat.filemode(info.st_mode)})"
    return None


def _others_link(path: str) -> str | None:
    """Why not, if a folder on the way to ``path`` (as the user named it) is a symbolic link of another user's (they
    could point it anywhere)."""
    for here in _folders_to(os.path.abspath(path)):
        info = os.lstat(here)
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.geteuid(), 0):
            return (f"{here} is a symbolic link of {_user(info.st_uid)}, who can point it anywhere. "
                    f"HINT: {_OWN_FOLDER}")
    return None


def _unsafe_path(fast_dirpath: str) -> str | None:
    """None if no one but this user and root can rename or replace ``fast_dirpath`` (a real path), a folder on its
    way, or what it holds; else why, and what to do."""
    for here in _folders_to(fast_dirpath):
        info = os.lstat(here)
        where = "in it" if here == fast_dirpath else f"below it, in {fast_dirpath}"
        if stat.S_ISLNK(info.st_mode):
            return f"{here} became a symbolic link while this job started. HINT: {_OWN_FOLDER}"
        if info.st_uid not in (os.geteuid(), 0):
            return f"{here} belongs to {_user(info.st_uid)}, who can replace this run's folder {where}. HINT: {_OWN_FOLDER}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"{here} can be written by other users (mode {stat.filemode(info.st_mode)}) and has no sticky "
                    f"bit (as /dev/shm has): any of them can replace this run's folder {where}. HINT: chmod +t or "
                    f"go-w {here}, or {_OWN_FOLDER}")
    return None


def _folders_to(path: str) -> list[str]:
    """``/``, then each folder down to ``path`` (absolute).

    Example:
        >>> _folders_to("/dev/shm/ft")
        ['/', '/dev', '/dev/shm', '/dev/shm/ft']
    """
    parts = [part for part in path.split("/") if part]
    return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
