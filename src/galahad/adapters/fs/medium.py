"""How bytes reach files and come back: atomic, durable writes and reads into caller buffers.

A write goes to a fresh temp name in the final folder, is written whole (looping on short
writes), gets its modification time set (the store's recency tick), is fsynced, and is then
hard-linked to its final name, which fails if that name exists (so a put never replaces a
stored part), and the folder is fsynced. A reader opens a final name once and reads from that
descriptor, so a file removed meanwhile still reads whole. Every name is opened, linked and
removed relative to the descriptor of its folder (`dir_fd`, a folder tree.py trusts), never by
a path through the folders; the path given beside it only names the file in messages.

Buffered I/O: the page cache is what makes a warm restart's loads fast, and every filesystem
takes it. Parts of two chunks or more are moved as several chunk-sized ranges by the thread pool
(preadv and pwritev release the interpreter lock).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from typing import TypeVar

from galahad.adapters.posix.atomic import ABSENT, CREATE, unlink_quietly, write_atomically
from galahad.adapters.posix.vectored import IOV_MAX, advance, pwritev_all
from galahad.domain.error import StoreUnavailable

__all__ = ["ABSENT", "CHUNK", "Medium", "run_all", "unavailable", "unlink_quietly", "write_file"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

CHUNK = 16 << 20  # a part of 2 * CHUNK bytes or more moves as CHUNK-sized ranges, in parallel
_HINTS = {
    errno.ENOSPC: " (the disk is full: free space or lower GALAHAD_MAX_BYTES)",
    errno.EDQUOT: " (disk quota exceeded: raise the quota or lower GALAHAD_MAX_BYTES)",
    errno.EACCES: " (check the owner and mode of the store folder)",
    errno.EPERM: " (check the owner and mode of the store folder)",
    errno.EROFS: " (the filesystem is mounted read-only: remount it read-write, or point GALAHAD_CACHE_DIR at a writable disk)",
    errno.EIO: " (the disk reported an I/O error: check the disk and the kernel log)",
}


def unavailable(action: str, path: str, exc: OSError) -> StoreUnavailable:
    """A `StoreUnavailable` naming what failed, where, and the likely fix."""
    code = exc.errno or errno.EIO
    return StoreUnavailable(code, f"cannot {action} {path}: {os.strerror(code)}{_HINTS.get(code, '')}")


def _touch(fd: int, tick_ns: int) -> None:
    """Record a use in the file's modification time; a read-only medium just keeps the old one."""
    try:
        os.utime(fd, ns=(tick_ns, tick_ns))
    except OSError:
        pass


def _close_read(fd: int) -> None:
    """Close a descriptor that was only read: its close cannot lose anything (on a network
    filesystem it can still fail, e.g. ESTALE for a file another node removed meanwhile)."""
    try:
        os.close(fd)
    except OSError:
        pass


def _preadv_all(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset`, looping on short reads; fewer bytes only at end of file."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _preadv_views(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill `views` in order from `offset`, looping on short reads; fewer bytes only at end of file."""
    pending = [v for v in views if len(v)]
    done = i = 0
    while i < len(pending):
        n = os.preadv(fd, pending[i : i + IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        i = advance(pending, i, n)
    return done


def _split_views(views: Sequence[memoryview], split: bool) -> list[tuple[int, list[memoryview]]]:
    """(file offset, views) ranges of CHUNK bytes, or one range when not worth splitting."""
    total = sum(len(v) for v in views)
    if not split or total < 2 * CHUNK:
        return [(0, list(views))]
    ranges: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    room = CHUNK
    for view in views:
        while len(view):
            k = min(len(view), room)
            current.append(view[:k])
            view, room = view[k:], room - k
            if room == 0:
                ranges.append((len(ranges) * CHUNK, current))
                current, room = [], CHUNK
    if current:
        ranges.append((len(ranges) * CHUNK, current))
    return ranges


class Medium:
    """Reads and writes of whole files for one store; `pool` moves the ranges of large files."""

    def __init__(self, pool: concurrent.futures.Executor) -> None:
        self._pool = pool

    # -- writes ------------------------------------------------------------------------------

    def write_new(self, dir_fd: int, folder: str, name: str, views: Sequence[memoryview], tick_ns: int, *,
                  split: bool) -> bool:
        """Write `name` into the folder open at `dir_fd` (`folder` names it) atomically and durably
        unless it exists; True if this call wrote it. Its caller (the store's placing) has just
        found the name absent: it is not looked up again."""
        def fill(tmp: str) -> int:
            fd = os.open(tmp, CREATE, 0o600, dir_fd=dir_fd)
            try:
                self._map(lambda r: pwritev_all(fd, r[1], r[0]), _split_views(views, split))
            except BaseException:
                os.close(fd)
                raise
            return fd

        return _write_atomically(dir_fd, folder, name, fill, tick_ns, replace=False, looked=True)

    def write_placed(self, dir_fd: int, folder: str, name: str, place: Callable[[int, str, int], bool],
                     tick_ns: int) -> bool:
        """`write_new` done by `place(dir_fd, name, tick_ns)` (another process: a writer), which
        writes and names the file as `write_atomically` does; its refusals are the medium's."""
        return _writing(folder, name, lambda: place(dir_fd, name, tick_ns))

    # -- reads -------------------------------------------------------------------------------

    def read(self, dir_fd: int, name: str, path: str, tick_ns: int) -> bytes | None:
        """The whole file `name` of the folder open at `dir_fd` (buffered; `path` names it), or
        None if it is not there."""
        opened = self._open_read(dir_fd, name, path)
        if opened is None:
            return None
        fd, size = opened
        try:
            pieces: list[bytes] = []
            done = 0
            while done < size:
                piece = os.pread(fd, size - done, done)
                if not piece:
                    break
                pieces.append(piece)
                done += len(piece)
            _touch(fd, tick_ns)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        except StoreUnavailable:
            raise
        except OSError as exc:
            if exc.errno in ABSENT:  # removed by another node meanwhile (a network filesystem): a miss
                return None
            raise unavailable("read", path, exc) from exc
        finally:
            _close_read(fd)

    def read_into(self, dir_fd: int, name: str, path: str, buf: memoryview, tick_ns: int, *, split: bool) -> int | None:
        """Fill `buf` (a writable byte view) with the file `name` of the folder open at `dir_fd`;
        its size, or None if it is not there."""
        opened = self._open_read(dir_fd, name, path)
        if opened is None:
            return None
        fd, size = opened
        try:
            if len(buf) < size:
                raise ValueError(f"buffer of {len(buf)} bytes is too small for {path} ({size} bytes)")
            bounds = [(s, min(s + CHUNK, size)) for s in range(0, size, CHUNK)]
            if not split or len(bounds) < 2:
                bounds = [(0, size)]
            counts = self._map(lambda b: _preadv_all(fd, buf[b[0] : b[1]], b[0]), bounds)
            _touch(fd, tick_ns)
            total = 0
            for (start, end), n in zip(bounds, counts):
                total += n
                if n < end - start:
                    break
            return total
        except StoreUnavailable:
            raise
        except OSError as exc:
            if exc.errno in ABSENT:  # removed by another node meanwhile (a network filesystem): a miss
                return None
            raise unavailable("read", path, exc) from exc
        finally:
            _close_read(fd)

    def open_part(self, dir_fd: int, name: str, path: str, tick_ns: int) -> tuple[int, int] | None:
        """(descriptor, size) of the part file `name` of the folder open at `dir_fd`, its use
        recorded (`tick_ns`), or None if it is not there. For `readv`; the caller closes the
        descriptor."""
        opened = self._open_read(dir_fd, name, path)
        if opened is not None:
            _touch(opened[0], tick_ns)
        return opened

    @staticmethod
    def readv(fd: int, offset: int, views: Sequence[memoryview]) -> int:
        """The file's bytes from `offset` on into `views` (writable byte views), in order: their
        count, fewer only at end of file. One `preadv` (looping on short reads), outside the
        interpreter lock."""
        return _preadv_views(fd, views, offset)

    def _open_read(self, dir_fd: int, name: str, path: str) -> tuple[int, int] | None:
        """(descriptor, size) of the regular file `name` of the folder open at `dir_fd` (`path`
        names it), or None if there is none (a symlink, a folder or a FIFO planted there is none:
        not followed, not read, never waited on)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("open", path, exc) from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            _close_read(fd)
            if exc.errno in ABSENT:
                return None
            raise unavailable("open", path, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            _close_read(fd)
            return None
        return fd, st.st_size

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """`fn` over `items`, on the pool when more than one; every call has ended on return."""
        if len(items) == 1:
            return [fn(items[0])]
        return run_all(self._pool, fn, items)


def run_all(pool: concurrent.futures.Executor, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """`fn` over `items` on `pool`; every call has ended before the first failure is raised."""
    futures = []
    try:
        for item in items:
            futures.append(pool.submit(fn, item))
    except RuntimeError as exc:  # the pool was shut down: the store is closing
        raise StoreUnavailable(errno.EBADF, "the store is closed") from exc
    finally:
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def write_file(dir_fd: int, folder: str, name: str, data: bytes, tick_ns: int, *, replace: bool = False,
               looked: bool = False) -> bool:
    """A small file (marker, manifest) written atomically and durably, buffered, into the folder
    open at `dir_fd` (`folder` names it).

    Without `replace`, an existing name is kept and False returned; with it, the name is taken.
    `looked`: the caller has just found the name absent (`_write_atomically`).
    """

    def fill(tmp: str) -> int:
        fd = os.open(tmp, CREATE, 0o600, dir_fd=dir_fd)
        try:
            pwritev_all(fd, [memoryview(data)], 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return _write_atomically(dir_fd, folder, name, fill, tick_ns, replace=replace, looked=looked)


def _write_atomically(dir_fd: int, folder: str, name: str, fill: Callable[[str], int], tick_ns: int, *,
                      replace: bool, looked: bool = False) -> bool:
    """`galahad.adapters.posix.atomic.write_atomically` in the folder open at `dir_fd` (`folder`
    names it), a failure of the medium raised as `StoreUnavailable` naming the file."""
    return _writing(folder, name, lambda: write_atomically(dir_fd, name, fill, tick_ns, replace=replace, looked=looked))


def _writing(folder: str, name: str, write: Callable[[], bool]) -> bool:
    """`write()` of the file `name` of `folder`, a failure of the medium raised as
    `StoreUnavailable` naming the file."""
    try:
        return write()
    except StoreUnavailable:
        raise
    except OSError as exc:
        raise unavailable("write", f"{folder}/{name}", exc) from exc
