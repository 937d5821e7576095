"""Reading ahead at startup (GALAHAD_PRELOAD_BYTES): the store's most recently used entries
read and verified into memory while the engine finishes starting, so that the first requests
after a restart load them with no read of the disk."""

from __future__ import annotations

import logging
import threading
import time

from galahad.adapters.cuda.pinned import PinnedBuffer, PinnedPool
from galahad.adapters.cuda.transfer import CudaBlockTransfer
from galahad.adapters.vllm.metadata import EntryRef
from galahad.adapters.vllm.worker.context import WorkerContext
from galahad.adapters.vllm.worker.parts import ReadPart, Source
from galahad.app.service import KVCacheService
from galahad.app.service import LoadedPart as StoredPart

__all__ = ["StartupReadAhead", "available_memory"]

log = logging.getLogger(__name__)

KEEP_S = 300.0  # parts read ahead and not asked for this long after the read-ahead go back


class _Preloaded:
    """A part read ahead, verified; on the CUDA path in `pinned`, a piece of the pinned arena,
    else in the part's own memory."""

    def __init__(self, part: StoredPart, pinned: PinnedBuffer | None) -> None:
        self.part, self.pinned = part, pinned


class StartupReadAhead:
    """`budget`: GALAHAD_PRELOAD_BYTES (None: auto, see `start`)."""

    def __init__(self, ctx: WorkerContext, budget: int | None) -> None:
        self._ctx = ctx
        self.budget = budget
        self.arena_bytes = 0  # the CUDA path's pinned arena, reserved at registration
        self._lock = threading.Lock()
        self._parts: dict[bytes, _Preloaded] = {}  # by key, in recency order (oldest first)
        self.until = 0.0  # monotonic; after it, parts read ahead and not asked for go back
        self.stopping = False

    def keys(self) -> set[bytes]:
        with self._lock:
            return set(self._parts)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def start(self) -> None:
        """Read this rank's parts of the store's most recently used entries on a thread of their own.

        `auto` (None, the default): on the CUDA path as much as the pinned arena reserved at
        registration holds (what loads copy through anyway: no memory is added); on the byte
        path nothing. On the CUDA path never more than that arena: it is taken here, in one
        piece, on the engine's thread, and the reading thread only cuts it up (no CUDA call
        there: vLLM may be capturing CUDA graphs meanwhile). Off for a perturbing test run."""
        ctx = self._ctx
        service, cuda = ctx.service, ctx.cuda
        budget = self.budget
        if budget is None:
            budget = self.arena_bytes if cuda is not None else 0
        if service is None or ctx.blocks is None or ctx.perturb or budget <= 0:
            return
        block = None
        if cuda is not None:
            if self.arena_bytes <= 0:  # no arena was reserved: nothing to read into
                return
            block = cuda.pool.acquire(min(budget, self.arena_bytes))
            if block is None or block.arena is None:
                if block is not None:
                    cuda.pool.release(block)
                log.info("[galahad] worker rank %d: nothing read ahead at startup (no free pinned arena)", ctx.rank)
                return
            budget = min(budget, block.capacity)
        else:  # ordinary memory: never more than half of what the host has available now
            room = available_memory() // 2
            if room and budget > room:
                log.info("[galahad] worker rank %d: GALAHAD_PRELOAD_BYTES=%d is more than half the memory "
                         "available (%d MiB); reading ahead at most %d MiB", ctx.rank, budget,
                         2 * room >> 20, room >> 20)
                budget = room
        threading.Thread(target=self._run, args=(service, budget, block), name="galahad-preload",
                         daemon=True).start()

    def _run(self, service: KVCacheService, budget: int, block: PinnedBuffer | None) -> None:
        """Each part read and verified as any load is (`load_part`: a damaged one is refused,
        counted and quarantined), least recent first, so the reads leave the entries' recency in
        the order it was. What is left of `block` goes back to the pool at the end."""
        rank = self._ctx.rank
        t0, nbytes, done = time.monotonic(), 0, 0
        rest = block
        try:
            cost = PinnedPool.footprint if block is not None else None
            for key, size in reversed(service.recent_parts(rank, budget, cost=cost)):
                if self.stopping:
                    break
                pinned = None
                if block is not None:  # the CUDA path: into the arena only, never ordinary memory
                    if rest is None:
                        break
                    cut = PinnedPool.carve(rest, size)
                    if cut is None:
                        continue
                    pinned, rest = cut
                try:
                    part = service.load_part(key, rank, fail=False, max_bytes=size,
                                             out=pinned.memoryview(size) if pinned is not None else None)
                except BaseException:
                    self._release(pinned)  # its piece of the arena
                    raise
                if part is None:  # refused (counted), or gone meanwhile
                    self._release(pinned)
                    continue
                with self._lock:
                    self._parts[key.raw] = _Preloaded(part, pinned)
                nbytes += part.header.payload_len
                done += 1
        except Exception:  # noqa: BLE001 - a thread boundary: what was read ahead is kept
            log.warning("[galahad] worker rank %d: reading ahead at startup stopped", rank, exc_info=True)
        finally:
            self._release(rest)
            self.until = time.monotonic() + KEEP_S
        if done:
            service.count(preloaded=done)
            log.info("[galahad] worker rank %d: read ahead %d of the store's most recently used entries "
                     "(%.2f GB) in %.2f s; their first loads read nothing from the disk (GALAHAD_PRELOAD_BYTES)",
                     rank, done, nbytes / 1e9, time.monotonic() - t0)

    def _release(self, piece: PinnedBuffer | None) -> None:
        """A piece of the arena the read-ahead held goes back to the pool (None: nothing held)."""
        if piece is not None and self._ctx.cuda is not None:
            self._ctx.cuda.pool.release(piece)

    def take(self, entry: EntryRef) -> ReadPart | None:
        """The entry's part as read ahead, if it was and fits the entry (else it goes back and the
        entry is read from the disk, as any other); counted `preloaded_loads`."""
        if not self._parts:
            return None
        ctx = self._ctx
        with self._lock:
            pre = self._parts.pop(entry.key, None)
        if pre is None:
            return None
        problem = ctx.misfit(entry, pre.part)
        if not problem and pre.pinned is not None and ctx.cuda is not None:
            problem = "" if ctx.cuda.payload_bytes(ctx.nrows(entry)) == pre.part.header.payload_len else "size"
        if problem:
            self._release(pre.pinned)
            return None
        if ctx.service is not None:
            ctx.service.count(preloaded_loads=1)
        return ReadPart(pre.part, Source.PRELOADED, pre.pinned)

    def acquire(self, cuda: CudaBlockTransfer, nbytes: int, shared: bool) -> PinnedBuffer | None:
        """`cuda.pool.acquire` for a save or a load (None: no free pinned buffer fits; nothing
        is pinned on a request's path). While parts read ahead hold the pinned arena, they go
        back first, least recently used first (the load of each then reads the disk, as
        without the read-ahead)."""
        while self._parts:
            buf = cuda.pool.acquire(nbytes, shared=shared)
            if buf is not None:
                return buf
            with self._lock:
                key = next(iter(self._parts), None)  # read ahead in recency order, oldest first
                pre = self._parts.pop(key) if key is not None else None
            if pre is not None:
                self._release(pre.pinned)
        return cuda.pool.acquire(nbytes, shared=shared)

    def expire(self, now: float | None = None) -> None:
        """Parts no request asked for within `KEEP_S` of the read-ahead (or all of them, at
        close: `now` None) give their memory back."""
        if not self._parts or (now is not None and (not self.until or now < self.until)):
            return
        with self._lock:
            gone, self._parts = list(self._parts.values()), {}
        for pre in gone:
            self._release(pre.pinned)
        if now is not None and gone:
            log.info("[galahad] worker rank %d: %d entries read ahead at startup were not asked for within "
                     "%.0f s; their memory goes back", self._ctx.rank, len(gone), KEEP_S)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0: unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
