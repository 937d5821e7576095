"""Buffers the kernel zeroes page by page as they are first written.

A `bytearray(n)` is zeroed at once by the thread that makes it, holding the interpreter lock: a
302 MB buffer for a sealed part held every other thread of the process, the engine's among them,
for 157 ms (`bench/save_stall.py`). Anonymous mapped memory costs one system call to make; each
page is zeroed by the kernel when the thread that writes it (a frame thread sealing outside the
lock) first touches it.
"""

from __future__ import annotations

import mmap

__all__ = ["kernel_zeroed"]


def kernel_zeroed(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` zero bytes, its pages zeroed by the kernel on first write;
    the memory goes back when the last view of it is dropped."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]
