"""A file written atomically and durably into a folder open on a descriptor: a temp file made
there and written, stamped with its tick, fsynced, given its name (kept if the name is taken),
the folder fsynced. A crash leaves the whole file or none at its name (a temp file at most, which
the store's scans remove).

Shared by the filesystem store (its medium: parts, markers, manifests) and the writer processes,
which place the parts they seal themselves (galahad.adapters.helpers): the same steps either way,
always inside a folder whose descriptor the store opened and checked (galahad.adapters.fs.tree),
so a writer process needs no path and follows no link. Errors are plain `OSError`s; the store
names what failed and where."""

from __future__ import annotations

import errno
import itertools
import os
import secrets
from collections.abc import Callable

__all__ = ["ABSENT", "CREATE", "TEMP_PREFIX", "exists", "unlink_quietly", "write_atomically"]

TEMP_PREFIX = ".tmp-"  # every temp file's name starts so (the store's scans remove stale ones)
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ESTALE})  # errors that mean: nothing there
# (ESTALE: on a shared network filesystem, another node removed or replaced the file this node
# last saw at the name; a miss is always safe, and the next lookup sees the new one)
_NO_LINK = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS})


class _TempNames:
    """Names of temp files, unique among this process's (a counter) and every other's on any
    host (a random stem, drawn again in a forked child): one random draw per process, not one
    per file written."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self.renew()
        os.register_at_fork(after_in_child=self.renew)

    def renew(self) -> None:
        self._stem = f"{TEMP_PREFIX}{secrets.token_hex(6)}-"

    def __call__(self) -> str:
        return f"{self._stem}{next(self._count):x}"


_temp_name = _TempNames()


def exists(name: str, dir_fd: int) -> bool:
    """Whether anything is at `name` in the folder open at `dir_fd` (a link is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in ABSENT:
            return False
        raise


def unlink_quietly(name: str, dir_fd: int) -> bool:
    """Remove the file `name` of the folder open at `dir_fd`; False if it was not there or could
    not be removed."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def write_atomically(dir_fd: int, name: str, fill: Callable[[str], int], tick_ns: int, *, replace: bool,
                     looked: bool = False) -> bool:
    """`name` in the folder open at `dir_fd`, written whole and durably: `fill(tmp)` creates the
    temp file `tmp` there (`CREATE`), writes it and returns it open; it is stamped with `tick_ns`,
    fsynced, closed and given its name (kept if the name exists, unless `replace`), and the folder
    fsynced. Whether this call gave it the name. `looked`: the caller has just found the name
    absent, so it is not looked up again (a name taken since is still kept: the link refuses
    it). On any failure the temp file is removed and the error raised."""
    tmp = _temp_name()
    try:
        if not replace and not looked and exists(name, dir_fd):
            return False
        fd = fill(tmp)
        try:
            os.utime(fd, ns=(tick_ns, tick_ns))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            placed = True
        else:
            placed = _link(dir_fd, tmp, name)
            unlink_quietly(tmp, dir_fd)
        if placed:
            os.fsync(dir_fd)
        return placed
    except BaseException:
        unlink_quietly(tmp, dir_fd)
        raise


def _link(dir_fd: int, tmp: str, final: str) -> bool:
    """Give the written temp file its final name unless that name exists; True if it did."""
    try:
        os.link(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    if exists(final, dir_fd):  # no hard links here (some FUSE and SMB mounts): rename, almost atomically
        return False
    os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True
