"""Vectored file I/O that loops on short transfers: a part's buffers written (or read) whole with
as few system calls as the kernel allows. Shared by the store's medium and the writer processes."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "advance", "pwritev_all"]

IOV_MAX = 1024  # buffers one preadv/pwritev takes at most (Linux's UIO_MAXIOV)


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Write every view from `offset` on, looping on short writes; the bytes written."""
    pending = [v for v in views if len(v)]
    start, i = offset, 0
    while i < len(pending):
        n = os.pwritev(fd, pending[i : i + IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "the disk accepted no bytes")
        offset += n
        i = advance(pending, i, n)
    return offset - start


def advance(pending: list[memoryview], i: int, n: int) -> int:
    """After `n` more bytes moved: the index of the first view not done (a partly done one is cut)."""
    while n and i < len(pending):
        if n >= len(pending[i]):
            n -= len(pending[i])
            i += 1
        else:
            pending[i] = pending[i][n:]
            n = 0
    return i
