"""How much of a file the page cache holds now: `mincore(2)` over a read-only mapping of it.

The load-or-recompute choice needs it: reading a part from the page cache runs at memory speed,
reading it from the disk at the disk's (on the H200 machine 7-9 GB/s per thread against about
1.4 GB/s). Mapping a file reads nothing; `mincore` asks the kernel which of its pages are
resident. Where that cannot be asked (no libc `mincore`, an error), the answer is None: unknown.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

__all__ = ["resident_share"]

_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC: list[ctypes.CDLL | None] = []  # loaded at first use, not at import
_LOW_BIT = bytes(b & 1 for b in range(256))  # translate table: each mincore byte to its bit 0


def resident_share(path: str) -> float | None:
    """Share (0.0-1.0) of `path`'s pages in the page cache now; None when it cannot be told."""
    if not _LIBC:
        _LIBC.append(_libc())
    libc = _LIBC[0]
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            # bit 0 of each byte: the page is resident (counted in C, not a Python loop)
            return vec.raw[:pages].translate(_LOW_BIT).count(1) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
