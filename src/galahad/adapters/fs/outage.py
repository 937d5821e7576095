"""When the store's filesystem stops answering: serve without the cache, and resume by itself.

A network filesystem can go away (its server killed, the connection lost, the mount detached:
every call fails at once with ENOTCONN, ENODEV...) or stall (a server that stops answering: a
call hangs until the client's own timeout, 42 s with GlusterFS's default `network.ping-timeout`,
forever on a hard NFS mount). Neither may hold the engine up or take it down.

`OutageGuard` keeps the store's state: answering, or out. A call that fails with an error that
means the filesystem itself is unreachable (`UNREACHABLE`), or, on network storage, a lookup that
does not answer within `limit_s` (it runs on one of the guard's threads; the caller waits that
long at most), puts the store out: one line is logged, naming the store and the cause, and from
then on every call fails at once (`StoreUnavailable`, no system call made), so lookups miss,
loads are recomputed and saves are skipped and counted, and the engine serves on. A prober
thread asks the filesystem every `probe_s` (a lookup of a name nobody uses, which no cache can
answer, bounded by `limit_s`); when it answers, and the store's path is on the filesystem it was
opened on (the same mount source and type: a remount counts as back), the guard's `on_back` runs
(the store forgets the folder descriptors it kept, which may belong to a mount that is gone), one
line says caching resumed, and calls go through again: no restart.

A path that now names another filesystem (the mount detached, leaving the empty folder beneath
it) is out as well: nothing is written to the disk beneath a mount point.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from galahad.adapters.fs.mount import Mount, mount_of
from galahad.domain.error import StoreUnavailable

__all__ = ["UNREACHABLE", "OutageGuard"]

_log = logging.getLogger(__name__)

_R = TypeVar("_R")

UNREACHABLE = frozenset({
    errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENODEV,
    errno.ECONNABORTED, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOLINK, errno.ESHUTDOWN, errno.ENETDOWN,
    errno.ENETUNREACH, errno.EREMOTEIO,
})  # fmt: skip  (the filesystem, not one file. ESTALE is one file: another node replaced it)
LIMIT_S = 2.0  # a lookup on network storage that takes longer: the store is out
PROBE_S = 1.0  # how often an out store is asked whether it answers again
_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[object, ...]]
_CALL_THREADS = 8  # calls in flight at once; more wait their turn (within their own bound)


class OutageGuard:
    """The answering-or-out state of one store root (`path`, on `mount`, `dev` its st_dev).

    `bounded`: lookups run on the guard's threads with a `limit_s` wait (network storage);
    otherwise they run on the caller's thread and only their errors are looked at."""

    def __init__(self, path: str, *, bounded: bool, on_back: Callable[[], None], limit_s: float = LIMIT_S,
                 probe_s: float = PROBE_S) -> None:
        self.path = path
        self._on_back = on_back
        self._limit_s = limit_s
        self._probe_s = probe_s
        self._mount: Mount | None = mount_of(path)
        try:
            self._dev: int | None = os.stat(path).st_dev
        except OSError:
            self._dev = None
        self._lock = threading.Lock()
        self._out: StoreUnavailable | None = None
        self._since = 0.0
        self._closed = threading.Event()
        self._pool = _Callers(_CALL_THREADS) if bounded else None

    @property
    def out(self) -> bool:
        return self._out is not None

    def check(self) -> None:
        """Raise at once (no system call) while the store is out."""
        out = self._out
        if out is not None:
            raise StoreUnavailable(out.errno, str(out.strerror))

    def call(self, fn: Callable[..., _R], *args: object) -> _R:
        """`fn(*args)`, failing at once while the store is out; on network storage run on the
        guard's threads and waited for `limit_s` at most. An error meaning the filesystem is
        unreachable, or no answer in time, puts the store out."""
        self.check()
        if self._pool is None:
            try:
                return fn(*args)
            except StoreUnavailable as exc:
                self.note(exc)
                raise
        if self._closed.is_set():
            raise StoreUnavailable(errno.EBADF, f"store {self.path} is closed")
        future = self._pool.submit(fn, *args)
        try:
            return future.result(self._limit_s)
        except concurrent.futures.TimeoutError:
            raise self._go_out(errno.ETIMEDOUT, f"no answer within {self._limit_s:g} s") from None
        except StoreUnavailable as exc:
            self.note(exc)
            raise

    def note(self, exc: OSError) -> None:
        """Look at a failed call's error: one that means the filesystem is unreachable puts the
        store out."""
        if exc.errno in UNREACHABLE:
            self._go_out(exc.errno, os.strerror(exc.errno))

    def moved(self, dev: int | None) -> None:
        """The store's path was opened again and is on device `dev` (None: it names nothing now):
        when that is not the filesystem the store was opened on (the mount went away, leaving the
        folder beneath it), the store is out."""
        if dev is None:
            raise self._go_out(errno.ENODEV, "its folder is gone (the mount went away?)")
        if self._dev is not None and dev != self._dev and not self._same_mount():
            raise self._go_out(errno.ENODEV, "its path no longer names the filesystem the store was opened on "
                               "(the mount went away?)")

    def close(self) -> None:
        self._closed.set()
        if self._pool is not None:
            self._pool.close()

    # -- out and back ----------------------------------------------------------------------

    def _go_out(self, code: int, cause: str) -> StoreUnavailable:
        what = self._mount.fstype if self._mount is not None else "its filesystem"
        exc = StoreUnavailable(code, f"store {self.path} ({what}) is not answering ({cause}): serving without "
                                     f"the cache until it answers again")
        with self._lock:
            if self._out is not None or self._closed.is_set():
                return self._out or exc
            self._out = exc
            self._since = time.monotonic()
        _log.warning("[galahad] %s; lookups miss and saves are skipped meanwhile, and caching resumes by itself",
                     exc.strerror)
        threading.Thread(target=self._probe_until_back, name="galahad-fs-probe", daemon=True).start()
        return exc

    def _probe_until_back(self) -> None:
        while not self._closed.wait(self._probe_s):
            if self._answers():
                try:
                    self._on_back()
                except Exception:  # noqa: BLE001 - forgetting descriptors never stops the return
                    _log.debug("forgetting the store's descriptors failed", exc_info=True)
                with self._lock:
                    self._out = None
                    seconds = time.monotonic() - self._since
                _log.warning("[galahad] store %s answers again after %.1f s: caching resumed", self.path, seconds)
                return

    def _answers(self) -> bool:
        """Whether the store's path answers a lookup that no cache holds, within `limit_s`, on
        the filesystem the store was opened on."""
        answer: list[int | None] = []

        def ask() -> None:
            try:
                os.lstat(os.path.join(self.path, f".galahad-probe-{secrets.token_hex(8)}"))
            except FileNotFoundError:
                pass
            except OSError:
                return
            try:
                answer.append(os.stat(self.path).st_dev)
            except OSError:
                return

        asker = threading.Thread(target=ask, name="galahad-fs-probe-call", daemon=True)
        asker.start()
        asker.join(self._limit_s)
        while asker.is_alive():  # a stalled filesystem: one question at a time
            if self._closed.wait(self._probe_s):
                return False
            asker.join(0)
        if not answer or answer[0] is None:
            return False
        if self._dev is not None and answer[0] != self._dev:
            if not self._same_mount():
                return False
            self._dev = answer[0]  # mounted again: a new device number, the same filesystem
        return True

    def _same_mount(self) -> bool:
        """Whether the path's mount now has the source and type it had when the store opened."""
        now = mount_of(self.path)
        if self._mount is None or now is None:
            return False
        return (now.fstype, now.source) == (self._mount.fstype, self._mount.source)


class _Callers:
    """Daemon threads that run calls for `OutageGuard.call`, started as needed, up to `size`. A
    call stuck in a stalled filesystem keeps its thread, and must not keep the process from
    exiting (a `ThreadPoolExecutor` joins its threads at exit): these are daemon threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[..., _R], *args: object) -> concurrent.futures.Future[_R]:
        future: concurrent.futures.Future[_R] = concurrent.futures.Future()
        with self._lock:
            if self._idle == 0 and self._threads < self._size:
                self._threads += 1
                threading.Thread(target=self._work, name="galahad-fs-call", daemon=True).start()
            else:
                self._idle -= 1 if self._idle else 0
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        for _ in range(self._size):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1
