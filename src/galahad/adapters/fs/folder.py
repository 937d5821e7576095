"""Files in a trusted folder of a store (tree.py), named relative to its descriptor.

Lookups (`file_size`, `part_names`) answer "absent" (None, an empty list) for a name that is
not there and raise `StoreUnavailable` for anything else; `unlink` raises the `OSError` for its
caller to translate with the action it knows. `read_small` reads a marker the way
galahad.adapters.posix.regular_file reads the store's other small files: a regular file only, never a link
followed or a FIFO waited on, never past a size limit.
"""

from __future__ import annotations

import errno
import os
import stat

from galahad.adapters.fs.layout import parse_name, part_prefix
from galahad.adapters.fs.medium import ABSENT, unavailable
from galahad.adapters.fs.tree import names_in
from galahad.adapters.posix.regular_file import NotARegularFile, read_opened

__all__ = ["file_size", "part_names", "read_only", "read_small", "unlink"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def unlink(name: str, dir_fd: int) -> bool:
    """Remove the file `name` of the folder open at `dir_fd`; False if it was not there (other
    failures raise)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError as exc:
        if exc.errno in ABSENT:
            return False
        raise


def read_only(dir_fd: int) -> str:
    """Why nothing can be written in the folder open at `dir_fd` ("" when it can, or when that
    cannot be told): said once at open, so a store that serves reads only is not first noticed
    at the first skipped save."""
    try:
        if os.statvfs(dir_fd).f_flag & os.ST_RDONLY:
            return "the filesystem is mounted read-only"
        writable = os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd)
    except OSError:
        return ""
    return "" if writable else "this user cannot write to it"


def file_size(name: str, dir_fd: int, folder: str) -> int | None:
    """The size of the regular file `name` of the folder open at `dir_fd` (`folder` names it),
    or None if there is none."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in ABSENT:
            return None
        raise unavailable("look up", f"{folder}/{name}", exc) from exc
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def part_names(dir_fd: int, folder: str, keyhex: str) -> list[str]:
    """The part files of the entry `keyhex` in the folder open at `dir_fd`, in name order."""
    prefix = part_prefix(keyhex)
    try:
        names = names_in(dir_fd)
    except OSError as exc:
        if exc.errno in ABSENT:
            return []
        raise unavailable("list", folder, exc) from exc
    return sorted(n for n in names if n.startswith(prefix) and parse_name(n) is not None)


def read_small(name: str, dir_fd: int, folder: str, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file `name` of the folder open at `dir_fd`, at most `limit + 1`
    of them, and its `fstat`. `NotARegularFile` for anything else (a symbolic link too); the
    `OSError` of the call when it cannot be opened or read."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotARegularFile(f"{folder}/{name}", "a symbolic link", errno.ELOOP) from None
        raise
    return read_opened(fd, limit, f"{folder}/{name}")
