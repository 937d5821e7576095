"""A part file held open for ranged reads: the filesystem store's `PartReader`.

The store opens the final name once (no symlink followed, a regular file only), records the use,
and pins the entry so that eviction passes it by until the reader is closed. Reads are `preadv`
calls on that descriptor, straight into the caller's buffers and outside the interpreter lock,
so the frames of one part can be read by several threads at once; `read_stepwise` (a frame read
and hashed piece by piece) checks its arguments once, then only calls `os.preadv`, and
`read_hashed` does the same loop in C with the hash, the lock released once a frame, where that
loop was built (`galahad.adapters.posix.readhash`). A part removed
meanwhile (quarantined, or removed by another process) still reads whole from the open descriptor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from galahad.adapters.posix import readhash
from galahad.adapters.fs.medium import Medium, unavailable
from galahad.ports.store import read_stepwise

__all__ = ["FileReader"]


class FileReader:
    """A `PartReader` on one open part file (`FilesystemBlockStore.open_reader` makes them)."""

    def __init__(self, medium: Medium, path: str, fd: int, size: int, on_close: Callable[[], None]) -> None:
        self._medium = medium
        self._path = path
        self._fd = fd
        self._size = size
        self._on_close: Callable[[], None] | None = on_close
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        if self._fd < 0:
            raise ValueError(f"read from a closed reader of {self._path}")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"a read offset is a non-negative int, got {offset!r}")
        views = [_writable(buf) for buf in buffers]
        try:
            count = self._medium.readv(self._fd, offset, views)
        except OSError as exc:
            raise unavailable("read", self._path, exc) from exc
        return count

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int:
        """`PartReader.read_stepwise`. Buffered, the hot loop of a load (a frame's 512 KiB pieces):
        one `os.preadv` per piece straight into `view`, then `each`, the checks done once for the
        whole view. A short read (the part ends, or a signal cut the read short) finishes through
        `preadv`, which loops on short reads."""
        if self._fd < 0 or type(offset) is not int or offset < 0 or type(step) is not int or step < 1:
            return read_stepwise(self, offset, view, step, each)  # says what is wrong
        view = _writable(view)
        done, size, preadv = 0, len(view), os.preadv
        while done < size:
            piece = view[done : done + step]
            try:
                got = preadv(self._fd, [piece], offset + done)
            except OSError as exc:
                if self._fd < 0:
                    raise ValueError(f"read from a closed reader of {self._path}") from exc
                raise unavailable("read", self._path, exc) from exc
            if got != len(piece):
                return done + read_stepwise(self, offset + done, view[done:], step, each)
            each(piece)
            done += got
        return done

    def read_hashed(self, offset: int, view: memoryview, seed: int) -> tuple[int, bytes] | None:
        """`HashedReader.read_hashed`: a buffered read through the compiled loop; None (nothing
        read) where it was not built, on a closed reader or bad arguments (`read_stepwise` then
        says what is wrong)."""
        if self._fd < 0 or type(offset) is not int or offset < 0 or not readhash.available():
            return None
        view = _writable(view)
        try:
            return readhash.read_hashed(self._fd, offset, view, seed)
        except OSError as exc:
            if self._fd < 0:
                raise ValueError(f"read from a closed reader of {self._path}") from exc
            raise unavailable("read", self._path, exc) from exc

    def shareable_fd(self) -> int | None:
        """`ShareableReader.shareable_fd`: the part's descriptor, or None (closed)."""
        return None if self._fd < 0 else self._fd

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            release, self._on_close = self._on_close, None
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # read-only: nothing is lost; the descriptor is gone either way
                pass
        if release is not None:
            release()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileReader({self._path!r}, size={self._size}{', closed' if self._fd < 0 else ''})"


def _writable(buf: memoryview) -> memoryview:
    view = buf if isinstance(buf, memoryview) and buf.format == "B" and buf.ndim == 1 else memoryview(buf).cast("B")
    if view.readonly:
        raise ValueError("preadv needs writable buffers")
    return view
