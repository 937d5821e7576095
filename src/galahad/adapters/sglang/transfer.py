"""Bounded page reads, writes and lookups through the service, for SGLang's calling threads.

SGLang calls a storage backend from one thread per kind of work (prefetch queries, prefetch
reads, backups) and a hung call stalls that thread and, through the ranks' all-reduce, every
rank (research/sglang_hicache_api.md §4). So each call here hands its work to worker threads and
waits at most its limit (`timeout_s`, plus 5 s per GB): what has not finished by then is reported
not found (or not written), counted as a timeout, and never touches SGLang's memory afterwards:

- reads verify into private buffers on the pool; only the calling thread copies a verified page
  into the host pool, in order, and stops at the first page that is missing, refused or late;
- writes first copy the pages out of the host pool on the calling thread (SGLang may reuse those
  rows as soon as we return); a late write then still writes the right bytes.

Lookups, reads and writes each have their own small thread pool, like SGLang's own threads: a
long backup never delays a prefetch query, and a hung store only blocks the pool it hung in.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.adapters.sglang.key import page_span
from galahad.adapters.sglang.page import PageGeometry
from galahad.adapters.sglang.stats import BackendCounters, TransferLog

__all__ = ["PageTransfer"]

log = logging.getLogger(__name__)

Sink = Callable[[int, memoryview], None]
_SCRATCH_KEPT = 16  # page buffers kept for reuse, per page size
_SLOWEST_BYTES_PER_S = 200e6  # the slowest store we wait for: a call's limit grows 5 s per GB


class PageTransfer:
    """Page I/O of one backend instance over one service, each call bounded by `timeout_s`."""

    def __init__(self, service: Any, rank: int, timeout_s: float, counters: BackendCounters,
                 transfers: TransferLog, lock: threading.Lock, lanes: int = 1) -> None:
        self._svc = service
        self._rank = rank
        self._timeout = timeout_s
        self._counters = counters
        self._transfers = transfers
        self._lock = lock
        self._inflight: set[cf.Future[Any]] = set()
        self._scratch: dict[int, list[memoryview]] = {}
        self._warned: set[str] = set()
        self._lanes = max(1, lanes)
        self._pools = {
            "lookup": cf.ThreadPoolExecutor(2, thread_name_prefix="galahad-sglang-lookup"),
            "read": cf.ThreadPoolExecutor(self._lanes, thread_name_prefix="galahad-sglang-read"),
            "write": cf.ThreadPoolExecutor(self._lanes, thread_name_prefix="galahad-sglang-write"),
        }

    # -- lookups ----------------------------------------------------------------------------

    def leading_committed(self, keys: Sequence[ChainKey]) -> int:
        """How many keys from the start are committed entries (0 on error or timeout)."""
        if not keys:
            return 0
        found = self._bounded(self._pools["lookup"].submit(self._leading, list(keys)), default=0)
        return max(0, min(int(found), len(keys)))

    def committed(self, keys: Sequence[ChainKey]) -> set[ChainKey]:
        """The committed ones among `keys` (empty on error or timeout)."""
        if not keys:
            return set()
        return set(self._bounded(self._pools["lookup"].submit(self._committed, list(keys)), default=set()))

    def _leading(self, keys: list[ChainKey]) -> int:
        """How many keys from the start the service offers: committed and openable here (one it
        cannot open, sealed under a key it does not hold, is a miss the service says once)."""
        offers = self._svc.offers
        return next((i for i, key in enumerate(keys) if not offers(key)), len(keys))

    def _committed(self, keys: list[ChainKey]) -> set[ChainKey]:
        offers = self._svc.offers
        return {key for key in keys if offers(key)}

    # -- reads ------------------------------------------------------------------------------

    def read(self, keys: Sequence[ChainKey], geometry: PageGeometry, sink: Sink) -> list[bool]:
        """Load, verify and hand each page to `sink(i, payload)` in order; the leading run is True."""
        ok = [False] * len(keys)
        if not keys:
            return ok
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._limit(len(keys) * geometry.nbytes)
        futures = self._fan_out("read", self._load, [(key, geometry) for key in keys])
        done = 0
        try:
            for i, future in enumerate(futures):
                payload = self._wait(future, deadline)
                if payload is None:
                    break
                try:
                    sink(i, payload)
                except Exception as exc:  # noqa: BLE001 - a page we cannot place is a miss
                    self._failed("sink", exc)
                    break
                finally:
                    self._give_back(payload)
                ok[i] = True
                done += 1
        finally:
            for future in futures[done:]:
                future.cancel()
        self._count(pages_read=done, pages_asked=len(keys))
        self._svc.count(loads=done, tokens_loaded=done * geometry.page_size)
        self._transfers.read(done, done * geometry.nbytes, time.perf_counter() - t0)
        return ok

    def _load(self, key: ChainKey, geometry: PageGeometry) -> memoryview | None:
        scratch = self._take(geometry.nbytes)
        part = self._svc.load_part(key, self._rank, out=scratch)
        if part is None:
            self._give_back(scratch)
            return None
        if not geometry.matches(part.header) or len(part.payload) != geometry.nbytes:
            self._count(pages_refused=1)
            log.debug("[galahad] sglang page %s refused: its segments are not this pool's", key.hex[:16])
            return None
        return part.payload

    # -- writes -----------------------------------------------------------------------------

    def write(self, keys: Sequence[ChainKey], payloads: Sequence[list[memoryview]],
              geometry: PageGeometry) -> list[bool]:
        """Store private page copies; True for each page durable (written now or already there)."""
        ok = [False] * len(keys)
        if not keys:
            return ok
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._limit(len(keys) * geometry.nbytes)
        futures = self._fan_out("write", self._save, [(key, geometry, payload)
                                             for key, payload in zip(keys, payloads, strict=True)])
        with self._lock:
            self._inflight.update(futures)
        for future in futures:
            future.add_done_callback(self._forget)
        for i, future in enumerate(futures):
            ok[i] = bool(self._wait(future, deadline, default=False))
        stored = sum(ok)
        self._transfers.write(stored, stored * geometry.nbytes, time.perf_counter() - t0)
        return ok

    def _save(self, key: ChainKey, geometry: PageGeometry, payload: list[memoryview]) -> bool:
        svc = self._svc
        if svc.holds(key):  # an entry this server cannot open is set aside and written anew
            self._count(pages_present=1)
            return True
        written = svc.save_part(key, page_span(geometry.page_size), self._rank, geometry.segments, payload)
        durable = written or self._has_part(key)
        if durable:
            svc.commit(key)  # succeeds once every rank's part is durable (the last writer's call)
            self._count(pages_written=1 if written else 0, pages_present=0 if written else 1)
        return durable

    def _has_part(self, key: ChainKey) -> bool:
        svc = self._svc
        try:
            return svc.has_part(key, self._rank)
        except StoreUnavailable:
            return False

    def _take(self, nbytes: int) -> memoryview:
        """A private buffer for one page: reused, since fresh large buffers cost page faults."""
        with self._lock:
            free = self._scratch.get(nbytes)
            if free:
                return free.pop()
        return memoryview(bytearray(nbytes))

    def _give_back(self, view: memoryview) -> None:
        base = view.obj if isinstance(view.obj, bytearray) else None
        if base is None:
            return
        with self._lock:
            free = self._scratch.setdefault(len(base), [])
            if len(free) < _SCRATCH_KEPT:
                free.append(memoryview(base))

    def _forget(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(future)

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for writes that outlived their call. True when none is left."""
        with self._lock:
            pending = list(self._inflight)
        if not pending:
            return True
        _, not_done = cf.wait(pending, timeout=timeout_s)
        return not not_done

    # -- plumbing ---------------------------------------------------------------------------

    def _fan_out(self, kind: str, fn: Callable[..., Any], items: list[tuple[Any, ...]]) -> list[cf.Future[Any]]:
        """One future per item, run in order on `lanes` jobs of the `kind` pool.

        Few long jobs rather than one job per page: per-page jobs on a pool much larger than
        the machine's cores mostly wait on each other for the interpreter lock.
        """
        futures: list[cf.Future[Any]] = [cf.Future() for _ in items]
        lanes = min(self._lanes, len(items))
        for lane in range(lanes):
            self._pools[kind].submit(_run_lane, fn, items, futures, lane, lanes)
        return futures

    def close(self) -> None:
        """Stop taking work; threads stuck in a hung store are left behind, not waited for."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def _limit(self, nbytes: int) -> float:
        """The time one call may take: the configured limit, plus 5 s per GB it moves."""
        return self._timeout + nbytes / _SLOWEST_BYTES_PER_S

    def _bounded(self, future: cf.Future[Any], default: Any) -> Any:
        result = self._wait(future, time.monotonic() + self._timeout, default=default)
        return default if result is None else result

    def _wait(self, future: cf.Future[Any], deadline: float, default: Any = None) -> Any:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            future.cancel()
            self._count(timeouts=1)
            self._warn_once("timeout", "[galahad] SGLang store call ran past its limit (galahad_timeout_s="
                            "%.1f s, plus 5 s per GB): answered not found; later ones are counted as "
                            "timeouts", self._timeout)
        except cf.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - a worker's failure is a miss, counted
            self._failed("worker", exc)
        return default

    def _failed(self, topic: str, exc: BaseException) -> None:
        self._count(errors=1)
        self._warn_once(topic, "[galahad] SGLang store call failed (%s: %s): answered not found; "
                        "later failures are counted as errors", type(exc).__name__, exc)

    def _warn_once(self, topic: str, msg: str, *args: object) -> None:
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        (log.warning if first else log.debug)(msg, *args)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)


def _run_lane(fn: Callable[..., Any], items: list[tuple[Any, ...]], futures: list[cf.Future[Any]],
              start: int, step: int) -> None:
    for i in range(start, len(items), step):
        future = futures[i]
        if not future.set_running_or_notify_cancel():
            continue  # the caller gave up on it
        try:
            future.set_result(fn(*items[i]))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)
