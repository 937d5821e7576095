"""A checksum frame read from a descriptor and hashed in one call, outside the interpreter lock.

A plain load verifies every byte it reads: each frame's XXH3-128 is computed over the bytes as
they land in the destination. Done in Python, every piece is two round trips through the
interpreter lock (`os.preadv`, then the hash's `update`), so pieces small enough to be hashed
while still in the core's cache cost more in lock traffic than they save, and whole 4 MiB frames
are hashed back from memory instead. The compiled loop (`galahad.adapters.posix._readhash`, built from `csrc/readhash.c` at install) reads a frame in
`STEP`-byte pieces and hashes each one right after it landed, releasing the lock once a frame.

It is optional. Where it was not built (no C compiler at install), `available()` is False and the
readers use their Python loop (`PartReader.read_stepwise`), which gives the same bytes, the same
count and the same digest. Loading it does no work beyond the import.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["STEP", "available", "read_hashed"]

STEP = 256 << 10
"""Bytes per `pread` in the compiled loop: each piece is hashed while it is still in L2 (1 MiB a
core on common server CPUs). 64 KiB to 1 MiB read alike; whole 4 MiB frames are slower, hashed
back from memory."""

_Native = Callable[[int, int, memoryview, int, int], "tuple[int, bytes]"]

try:
    from galahad.adapters.posix._readhash import read_hashed as _compiled
except ImportError:  # not built: the Python loop serves
    _native: _Native | None = None
else:
    _native = _compiled


def available() -> bool:
    """Whether the compiled loop was built at install."""
    return _native is not None


def read_hashed(fd: int, offset: int, view: memoryview, seed: int) -> tuple[int, bytes]:
    """Fill `view` with the file's bytes from `offset` on (fewer only where the file ends) and
    return the count read and the XXH3-128 digest (seeded with `seed`, canonical byte order, as
    `xxhash.xxh3_128(seed=seed).digest()`) of exactly those bytes. A failed read raises `OSError`
    with its errno (an interrupted one is retried). Only where `available()`."""
    if _native is None:
        raise RuntimeError("the compiled read-and-hash loop was not built (galahad.adapters.posix.readhash.available() is False)")
    return _native(fd, offset, view, seed, STEP)
