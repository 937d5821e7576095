"""How much of a file the page cache holds now: `mincore(2)` over a read-only mapping of it.

The load-or-recompute choice needs it: reading a part from the page cache runs at memory speed,
reading it from the disk at the disk's (on an H200 host 7-9 GB/s per thread against about
1.4 GB/s). Mapping a file reads nothing; `mincore` asks the kernel which of its pages are
resident. Where that cannot be asked (no libc `mincore`, an error), the answer is None: unknown.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat

__all__ = ["resident_share"]

_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    """The C library's `mmap`, `munmap` and `mincore`, loaded at the first priced hit of a
    process, on the engine's thread: by glibc's name, else from the symbols the process already
    has (musl), never through `ctypes.util.find_library`, which runs `ldconfig` in a child
    process (milliseconds on a request's path)."""
    for name in ("libc.so.6", None):
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long)
            libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
            return libc
        except (OSError, AttributeError):
            continue
    return None


_LIBC: list[ctypes.CDLL | None] = []  # loaded at first use, not at import
_LOW_BIT = bytes(b & 1 for b in range(256))  # translate table: each mincore byte to its bit 0
_WHOLE = 4096  # files of up to this many pages (16 MiB) are asked about page by page
_WINDOWS, _WINDOW = 16, 64  # larger ones: 16 evenly spread windows of 64 pages (4 MiB asked)


def _resident(libc: ctypes.CDLL, addr: int, first: int, count: int) -> float | None:
    """Share of the `count` mapped pages from page `first` that are resident."""
    vec = ctypes.create_string_buffer(count)
    if libc.mincore(addr + first * _PAGE, count * _PAGE, vec) != 0:
        return None
    # bit 0 of each byte: the page is resident (counted in C, not a Python loop)
    return vec.raw[:count].translate(_LOW_BIT).count(1) / count


def resident_share(name: str, *, dir_fd: int | None = None) -> float | None:
    """Share (0.0-1.0) of the regular file `name`'s pages in the page cache now (`name` relative
    to the folder open at `dir_fd`, if given); None when it cannot be told. A symbolic link is
    not followed and a FIFO not waited on (None for both)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return _share(fd)
    finally:
        os.close(fd)


def _share(fd: int) -> float | None:
    """The resident share of the regular file open at `fd`; None when it cannot be told."""
    if not _LIBC:
        _LIBC.append(_libc())
    libc = _LIBC[0]
    if libc is None:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    size = st.st_size
    if size == 0:
        return 1.0
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        pages = (size + _PAGE - 1) // _PAGE
        if pages <= _WHOLE:
            return _resident(libc, addr, 0, pages)
        # A large file: evenly spread windows stand for it (the kernel's cost grows with the
        # pages asked about: 4 ms for a whole 300 MB part, on the path of every hit)
        step = pages // _WINDOWS
        got = [_resident(libc, addr, i * step, _WINDOW) for i in range(_WINDOWS)]
        if any(g is None for g in got):
            return None
        return sum(g for g in got if g is not None) / _WINDOWS
    finally:
        libc.munmap(addr, size)
