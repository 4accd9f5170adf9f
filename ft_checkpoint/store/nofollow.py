"""Local-disk file operations that never go through a symbolic link, nor wait on a special file.

Whoever can write the checkpoint directory may put a FIFO, a directory or a link (to ``/dev/zero``, to another
run's step) where ft-checkpoint expects its own files, or swap a step directory for a link between a listing and
a delete, a clear and a write, a check and a read. So, on local disk (``Storage`` calls these; object stores have
neither links nor special files), every directory below the root is opened with ``O_DIRECTORY | O_NOFOLLOW``,
one name at a time, and:

- a file is opened for reading relative to its directory with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
  ``fstat`` (a control file is also read up to a cap);
- a file is written relative to its directory: whatever holds its name is unlinked (a link, even a hard link,
  is removed itself) and the file is created afresh (``O_EXCL``), or written aside and renamed over its name;
- a directory is emptied relative to a descriptor of its own: only the names of its own listing are unlinked
  (a link is removed itself), then it is removed relative to its parent;
- a rename is made relative to the directories of both names.

The root of the checkpoint directory is opened as the user named it (it may be a link of theirs).

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.mkfifo(os.path.join(root, "lease.json"))
    >>> try:
    ...     read_regular_file(root, "lease.json", max_bytes=1024, url="lease.json")
    ... except CheckpointCorruptError as e:
    ...     print(str(e)[:50])
    lease.json is a FIFO, not a regular file: refusing
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import stat
import uuid
from collections.abc import Callable, Container, Iterator

from ft_checkpoint.errors import CheckpointCorruptError

log = logging.getLogger(__name__)
_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""How the root is opened: as the user named it (it may be a link of theirs)."""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a directory below the root is opened: never through a symbolic link."""
_NOT_A_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)
"""What opening ``_DIRECTORY`` answers for a link (ENOTDIR on Linux, ELOOP elsewhere) or a file."""
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_READ_SLICE = 16 << 20
_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""How a file is opened: never through a symbolic link, never waiting (a FIFO opens at once, for ``fstat``)."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a file is written: always a new one (a name that exists, even a link, is never opened)."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)
DirectoryId = tuple[int, int]
"""A directory's ``(st_dev, st_ino)``: which directory a name referred to when it was made."""


def too_large(url: str, max_bytes: int) -> CheckpointCorruptError:
    """The error for a control file larger than its cap.

    Example:
        >>> print(too_large("lease.json", 10))
        lease.json: larger than the 10 bytes a file of its kind may have; refusing to read it
    """
    return CheckpointCorruptError(f"{url}: larger than the {max_bytes} bytes a file of its kind may have; refusing "
                                  "to read it")


def read_regular_file(root: str, rel: str, *, max_bytes: int, url: str) -> bytes:
    """The bytes of ``root/rel`` if it is a regular file of at most ``max_bytes``; CheckpointCorruptError, at once,
    for a link (the file or a directory on its way below ``root``), a FIFO, a directory, a device or a larger file
    (``url`` names it in the message).

    Example:
        >>> read_regular_file(os.path.dirname(__file__), "nofollow.py", max_bytes=10, url="this module")
        Traceback (most recent call last):
        ft_checkpoint.errors.CheckpointCorruptError: this module: larger than the 10 bytes ...
    """
    data = read_regular_file_unless(root, rel, (), max_bytes=max_bytes, url=url)[1]
    assert data is not None  # nothing is known: the file is read
    return data


FileId = tuple[int, int]
"""A local file's identity: its device and inode (the same for every hard link to it)."""


def read_named_file(path: str, *, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of a file the user named (a config or key file: its path may go through links
    of theirs), opened without waiting: anything but a regular file there (a FIFO, ``/dev/stdin``, a directory) is an
    OSError, never a read that blocks forever.

    Example:
        >>> import os, tempfile
        >>> fifo = os.path.join(tempfile.mkdtemp(), "ft.yaml")
        >>> os.mkfifo(fifo)
        >>> try:
        ...     read_named_file(fifo, max_bytes=100)
        ... except OSError as e:
        ...     print(e)
        not a regular file (a FIFO)
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"not a regular file ({next((k for is_kind, k in _KINDS if is_kind(mode)), 'a special file')})")
        return _read_at_most(fd, max_bytes + 1)
    finally:
        os.close(fd)


def read_regular_file_unless(root: str, rel: str, known: Container[FileId], *, max_bytes: int,
                             url: str) -> tuple[FileId, bytes | None]:
    """``(identity, bytes)`` of ``root/rel``, checked and read as :func:`read_regular_file` does, except that a
    file whose identity is in ``known`` (read already, under this name or through a hard link) is not read: None.

    Example:
        >>> here = os.path.dirname(__file__)
        >>> identity, data = read_regular_file_unless(here, "nofollow.py", (), max_bytes=1 << 20, url="this module")
        >>> data[3:9], read_regular_file_unless(here, "nofollow.py", {identity}, max_bytes=1 << 20, url="x")[1]
        (b'Local-', None)
    """
    fd = open_regular_file(root, rel, url=url)
    try:
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino)
        if identity in known:
            return identity, None
        if info.st_size > max_bytes:
            raise too_large(url, max_bytes)
        return identity, _read_at_most(fd, max_bytes + 1)  # a file that grew since fstat: the caller sees the extra byte
    finally:
        os.close(fd)


def open_regular_file(root: str, rel: str, *, url: str, rewrite: bool = False) -> int:
    """A descriptor of ``root/rel`` open for reading, if it is a regular file: neither ``rel``'s directories nor
    the file are opened through a link, nor does the open wait (CheckpointCorruptError naming ``url`` at once for
    a link, a FIFO, a device, a socket or a directory). The caller reads from it (blocking) and closes it.
    ``rewrite``: open for writing in place instead (``pwrite``), and only a file with no other name (a hard link
    to another file would have that file overwritten).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); os.mkfifo(os.path.join(root, "shard"))
        >>> try:
        ...     open_regular_file(root, "shard", url="shard")
        ... except CheckpointCorruptError as e:
        ...     print(str(e)[:35])
        shard is a FIFO, not a regular file
    """
    parent, name = posixpath.split(rel)
    with open_directory(root, parent, url=url) as directory:
        return _open_regular(name, url, directory, rewrite=rewrite)


def _open_regular(path: str, url: str, directory: int | None = None, *, rewrite: bool = False) -> int:
    try:
        fd = os.open(path, (os.O_WRONLY if rewrite else os.O_RDONLY) | _FILE, dir_fd=directory)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a symbolic link; a socket (or, to write, a FIFO)
            raise
        kind = "a symbolic link" if e.errno == errno.ELOOP else "a FIFO or a socket" if rewrite else "a socket"
        raise _not_regular(url, kind, "write it" if rewrite else "read it") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(url, next((name for test, name in _KINDS if test(info.st_mode)), "a special file"))
        if rewrite and info.st_nlink != 1:
            raise CheckpointCorruptError(f"{url} has {info.st_nlink} names (hard links): refusing to write it in "
                                         "place (another file would change with it). HINT: remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(root: str, rel: str, *, url: str, direct: bool = False, exclusive: bool = False) -> int:
    """A descriptor of ``root/rel`` open for writing, a new empty regular file: the directories on its way are
    opened (or made) without following a link (CheckpointCorruptError naming ``url`` if one is a link or a file),
    and whatever held the name is unlinked first (a link or a hard link is removed itself, never its target).
    ``direct``: with ``O_DIRECT`` where the filesystem allows it. ``exclusive``: nothing is unlinked, and
    FileExistsError if anything holds the name (a save's file that another writer created first: see ``fence``).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); os.symlink("/etc/hostname", os.path.join(root, "a.bin"))
        >>> os.close(create_file(root, "step/a.bin", url="a.bin")); os.close(create_file(root, "a.bin", url="a.bin"))
        >>> sorted(os.listdir(root)), os.path.islink(os.path.join(root, "a.bin"))
        (['a.bin', 'step'], False)
    """
    parent, name = posixpath.split(rel)
    with open_directory(root, parent, url=url, create=True) as directory:
        if direct and _O_DIRECT:
            try:
                return _create(directory, name, url, _O_DIRECT, exclusive=exclusive)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.debug("no O_DIRECT for %s (%s): a buffered write", url, e)
                if exclusive:  # the refused open may have made the file, ours: the name was free
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=directory)
        return _create(directory, name, url, exclusive=exclusive)


def _create(directory: int, name: str, url: str, flags: int = 0, *, exclusive: bool = False) -> int:
    if exclusive:
        return os.open(name, _CREATE | flags, 0o644, dir_fd=directory)  # FileExistsError if the name is taken
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass
    except (IsADirectoryError, PermissionError):
        if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise _not_regular(url, "a directory", "write it") from None
        raise
    try:
        return os.open(name, _CREATE | flags, 0o644, dir_fd=directory)
    except FileExistsError:
        raise CheckpointCorruptError(f"{url}: another file took its name as it was written (someone else writes "
                                     "this directory?); nothing is written through it") from None


def replace_file(root: str, rel: str, data: bytes, *, url: str, fsync: bool, made: DirectoryId | None = None,
                 exclusive: bool = False) -> None:
    """Write ``data`` as ``root/rel`` atomically: into a new file beside it, renamed over its name, all relative
    to its directory opened (or made) without following a link (see :func:`create_file`). ``made``: what
    :func:`make_directory` returned for that directory; CheckpointCorruptError, nothing written, if its name
    refers to another directory now (swapped since). ``exclusive``: linked to its name instead of renamed over it,
    FileExistsError if the name exists (of two writers, one wins; a file system without hard links: renamed).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); made = make_directory(root, "step", url="step")
        >>> replace_file(root, "step/manifest.json", b"{}", url="manifest.json", fsync=False, made=made)
        >>> os.listdir(os.path.join(root, "step"))
        ['manifest.json']
    """
    parent, name = posixpath.split(rel)
    with open_directory(root, parent, url=url, create=True) as directory:
        if made is not None and _identity(os.fstat(directory)) != made:
            raise CheckpointCorruptError(f"{url}: its directory is no longer the directory this save created (it "
                                         "was swapped for another since); nothing is written there")
        tmp = f"{name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(_create(directory, tmp, url), "wb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            _put_in_place(directory, tmp, name, exclusive)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            raise
        if fsync:
            os.fsync(directory)


def _put_in_place(directory: int, tmp: str, name: str, exclusive: bool) -> None:
    """Give the complete file ``tmp`` the ``name``: renamed over it, or (``exclusive``) linked, never replacing one."""
    if exclusive:
        try:
            os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise  # FileExistsError among them
        else:
            os.unlink(tmp, dir_fd=directory)
            return
    os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)


def make_directory(root: str, rel: str, *, url: str) -> DirectoryId:
    """Make the directory ``root/rel``, which must not exist, without following a link on its way; its identity
    (CheckpointCorruptError naming ``url`` if anything took the name first, e.g. a link planted again).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); made = make_directory(root, "step", url="step")
        >>> made == (os.stat(root + "/step").st_dev, os.stat(root + "/step").st_ino)
        True
    """
    parent, name = posixpath.split(rel)
    with open_directory(root, parent, url=url, create=True) as directory:
        try:
            os.mkdir(name, dir_fd=directory)
        except FileExistsError:
            raise CheckpointCorruptError(f"{url}: something took this name right after it was cleared (a symbolic "
                                         "link planted again?); nothing is written there. HINT: make sure nothing "
                                         "else writes into the checkpoint directory") from None
        return _identity(os.stat(name, dir_fd=directory, follow_symlinks=False))


def _identity(info: os.stat_result) -> DirectoryId:
    return info.st_dev, info.st_ino


def _not_regular(url: str, kind: str, doing: str = "read it") -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{url} is {kind}, not a regular file: refusing to {doing} (nothing but the "
                                  "files ft-checkpoint writes belongs there). HINT: remove it")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left and (chunk := os.read(fd, min(left, _READ_SLICE))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def open_directory(root: str, rel: str, *, url: str | None = None, create: bool = False) -> Iterator[int]:
    """A descriptor of ``root/rel``: ``root`` as the user named it, each component of ``rel`` without following
    a link (NotADirectoryError or ELOOP if one is a link or a file; with ``url``, CheckpointCorruptError naming it).
    ``create``: missing directories are made (the root too).

    Example:
        >>> with open_directory("/", "") as fd:
        ...     "tmp" in os.listdir(fd)
        True
    """
    try:
        fd = _open_path(root, rel, create)
    except OSError as e:
        if url is None or e.errno not in _NOT_A_DIRECTORY:
            raise
        raise CheckpointCorruptError(f"{url}: a directory on its way is a symbolic link or not a directory; nothing "
                                     "is read or written through it") from e
    try:
        yield fd
    finally:
        os.close(fd)


def _open_path(root: str, rel: str, create: bool) -> int:
    try:
        fd = os.open(root, _ROOT)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, _ROOT)
    try:
        for part in filter(None, rel.split("/")):
            inner = _open_subdirectory(fd, part, create)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_subdirectory(parent: int, name: str, create: bool) -> int:
    try:
        return os.open(name, _DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_fd=parent)
    return os.open(name, _DIRECTORY, dir_fd=parent)


def rename(root: str, rel: str, new_rel: str, *, url: str) -> None:
    """Rename ``root/rel`` to ``root/new_rel`` atomically, relative to both directories opened without following
    a link; CheckpointCorruptError if one of them is a link or a file (``url`` names ``rel`` in the message).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); open(os.path.join(root, "a"), "w").close()
        >>> rename(root, "a", "b", url="a"); os.listdir(root)
        ['b']
    """
    (parent, name), (new_parent, new_name) = posixpath.split(rel), posixpath.split(new_rel)
    try:
        with open_directory(root, parent) as src, open_directory(root, new_parent) as dst:
            os.rename(name, new_name, src_dir_fd=src, dst_dir_fd=dst)
    except OSError as e:
        if e.errno not in _NOT_A_DIRECTORY:
            raise
        raise CheckpointCorruptError(f"{url}: a directory on its way is a symbolic link or not a directory; nothing "
                                     "is renamed through it") from e


def delete_directory(root: str, rel: str, *, first: str | None, url_of: Callable[[str], str],
                     unlink_link: bool = False) -> bool:
    """Empty and remove ``root/rel`` (``first`` unlinked before the other names of its own listing), never through
    a link; subdirectories are left, with a warning. Returns whether it is gone (see ``Storage.delete_directory``);
    a missing parent means there is nothing to delete. ``unlink_link``: a symbolic link in place of ``rel`` is
    removed itself (its target untouched), for a writer about to create ``rel``.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); os.makedirs(os.path.join(root, "step"))
        >>> os.symlink("/etc", os.path.join(root, "step", "l"))   # a link inside the step: removed, /etc is not
        >>> delete_directory(root, "step", first=None, url_of=str), os.listdir(root), os.path.isdir("/etc")
        (True, [], True)
        >>> delete_directory(root, "no/such/step", first=None, url_of=str)
        True
    """
    parent_rel, name = posixpath.split(rel)
    if not os.path.isdir(os.path.join(root, parent_rel)):  # nothing to delete (a link here fails below, unfollowed)
        return True
    with open_directory(root, parent_rel) as parent:
        try:
            directory = os.open(name, _DIRECTORY, dir_fd=parent)
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in _NOT_A_DIRECTORY:
                raise
            if unlink_link and stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
                log.warning("removed %s: a symbolic link in place of a step directory about to be written (its "
                            "target is untouched)", url_of(rel))
                os.unlink(name, dir_fd=parent)
                return True
            log.warning("left %s in place: it is a symbolic link or not a directory (swapped in after it was "
                        "listed?); nothing is deleted through it", url_of(rel))
            return False
        try:
            for entry in sorted(os.listdir(directory), key=lambda n: n != first):
                _unlink(directory, entry, url_of(f"{rel}/{entry}"))
        finally:
            os.close(directory)
        try:
            os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("left %s in place: %s", url_of(rel), e.strerror)
            return False
    return True


def _unlink(directory: int, name: str, url: str) -> None:
    """Unlink ``name`` inside the open ``directory`` (a link is removed itself); a directory is left, with a warning."""
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        log.warning("left %s in place: only files are deleted", url)
    except PermissionError:  # EPERM: what some systems answer for unlinking a directory
        if not stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise
        log.warning("left %s in place: only files are deleted", url)
