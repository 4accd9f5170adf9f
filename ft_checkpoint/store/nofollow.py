"""Local-disk file operations that never go through a symbolic link, nor wait on a special file.

Whoever can write the checkpoint directory may put a FIFO, a directory or a link (to ``/dev/zero``, to another
run's step) where ft-checkpoint expects its own files, or swap a step directory for a link between a listing and
a delete. So, on local disk (``Storage`` calls these; object stores have neither links nor special files):

- a control file is opened with ``O_NOFOLLOW | O_NONBLOCK``, checked with ``fstat`` and read up to a cap;
- a directory is emptied relative to a descriptor opened with ``O_DIRECTORY | O_NOFOLLOW``: only the names of
  its own listing are unlinked (a link is removed itself), then it is removed relative to its parent;
- a rename is made relative to the directories of both names, opened the same way.

The root of the checkpoint directory is opened as the user named it (it may be a link of theirs).

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.mkfifo(os.path.join(root, "lease.json"))
    >>> try:
    ...     read_regular_file(os.path.join(root, "lease.json"), max_bytes=1024, url="lease.json")
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
from collections.abc import Callable, Container, Iterator

from ft_checkpoint.errors import CheckpointCorruptError

log = logging.getLogger(__name__)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a directory below the root is opened: never through a symbolic link."""
_NOT_A_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)
"""What opening ``_DIRECTORY`` answers for a link (ENOTDIR on Linux, ELOOP elsewhere) or a file."""
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_READ_SLICE = 16 << 20


def too_large(url: str, max_bytes: int) -> CheckpointCorruptError:
    """The error for a control file larger than its cap.

    Example:
        >>> print(too_large("lease.json", 10))
        lease.json: larger than the 10 bytes a file of its kind may have; refusing to read it
    """
    return CheckpointCorruptError(f"{url}: larger than the {max_bytes} bytes a file of its kind may have; refusing "
                                  "to read it")


def read_regular_file(path: str, *, max_bytes: int, url: str) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``max_bytes``; CheckpointCorruptError, at once,
    for a link, a FIFO, a directory, a device or a larger file (``url`` names it in the message).

    Example:
        >>> read_regular_file(__file__, max_bytes=10, url="this module")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ft_checkpoint.errors.CheckpointCorruptError: this module: larger than the 10 bytes ...
    """
    with _open_regular(path, max_bytes=max_bytes, url=url) as (fd, _):
        return _read_at_most(fd, max_bytes + 1)  # a file that grew since fstat: the caller sees the extra byte


FileId = tuple[int, int]
"""A local file's identity: its device and inode (the same for every hard link to it)."""


def read_regular_file_unless(path: str, known: Container[FileId], *, max_bytes: int,
                             url: str) -> tuple[FileId, bytes | None]:
    """``(identity, bytes)`` of ``path``, checked and read as :func:`read_regular_file` does, except that a file
    whose identity is in ``known`` (read already, under this name or through a hard link) is not read: None.

    Example:
        >>> identity, data = read_regular_file_unless(__file__, (), max_bytes=1 << 20, url="this module")
        >>> data[3:9], read_regular_file_unless(__file__, {identity}, max_bytes=1 << 20, url="this module")[1]
        (b'Local-', None)
    """
    with _open_regular(path, max_bytes=max_bytes, url=url) as (fd, info):
        identity = (info.st_dev, info.st_ino)
        return identity, None if identity in known else _read_at_most(fd, max_bytes + 1)


@contextlib.contextmanager
def _open_regular(path: str, *, max_bytes: int, url: str) -> Iterator[tuple[int, os.stat_result]]:
    """A descriptor of ``path`` and its ``fstat``, if it is a regular file of at most ``max_bytes`` (see
    :func:`read_regular_file`); closed on exit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a symbolic link; a socket
            raise
        raise _not_regular(url, "a symbolic link" if e.errno == errno.ELOOP else "a socket") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(url, next((name for test, name in _KINDS if test(info.st_mode)), "a special file"))
        if info.st_size > max_bytes:
            raise too_large(url, max_bytes)
        yield fd, info
    finally:
        os.close(fd)


def _not_regular(url: str, kind: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{url} is {kind}, not a regular file: refusing to read it (nothing but the "
                                  "files ft-checkpoint writes belongs there). HINT: remove it")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left and (chunk := os.read(fd, min(left, _READ_SLICE))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def open_directory(root: str, rel: str) -> Iterator[int]:
    """A descriptor of ``root/rel``: ``root`` as the user named it, each component of ``rel`` without following
    a link (NotADirectoryError or ELOOP if one is a link or a file).

    Example:
        >>> with open_directory("/", "") as fd:
        ...     "tmp" in os.listdir(fd)
        True
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in filter(None, rel.split("/")):
            inner = os.open(part, _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


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
