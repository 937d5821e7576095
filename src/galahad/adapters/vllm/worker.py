"""Worker side of the connector: copy prompt blocks out for saving, load verified parts in.

Runs in every TP/PP worker process. Saves copy the blocks out in `wait_for_save` (so a block
freed or reused afterwards cannot be read half-written; on CUDA gathered on a save stream into a
reused pinned buffer, the compute stream waiting only for the device-side gather, and skipped,
counted, when every pinned buffer still waits for the disk) and seal + write on the service's
save threads. Loads copy only verified bytes into the KV cache: a sync job's entries as each
verified prefix of the job grows (on CUDA read straight into pinned buffers, then one scatter per
batch of entries; a job of one entry layer by layer as its frames verify), an asynchronous job's
entries on the worker thread once its read finished (read on the I/O pool). A job that fails
leaves vLLM exactly the blocks to recompute. Every load
job is reported finished exactly once, failed or not. Rank 0 also times the forward steps that
load nothing: the prefill figures of the load-or-recompute choice (`advisor.py`).

Pending loads: a save's copy of an entry (the pinned
buffer it was gathered into, or on the byte path its rows) is kept until its part is durable, as
it always was; meanwhile the worker reports it `held`, and a load of that entry copies it in from
there (counted `held_loads`), with no read of the disk: the disk may take seconds to make a
turn's saves durable, and the conversation's next turn should not wait for it or recompute.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from galahad.adapters.vllm.blocks import KVBlocks, LayerView, UnsupportedLayout
from galahad.adapters.vllm.cuda import CudaBlockTransfer, Gathered, Piece, PinnedBuffer, PinnedPool, transfer_for
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, GalahadWorkerMetadata, LoadJob
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.counter import MissReason
from galahad.domain.namespace import GroupKind, PayloadOrder
from galahad.domain.plan import StatePlan
from galahad.format.fanout import pools_stopped, usable_cores
from galahad.domain.rank import RankLayout
from galahad.app.service import KVCacheService, SegmentSpec
from galahad.app.service import LoadedPart as StoredPart
from galahad.adapters.helpers.reader_pool import ReaderPool

__all__ = ["GalahadWorker", "LoadOutcome", "part_bytes"]

log = logging.getLogger(__name__)

_SAVE_BATCH = 128 << 20  # a step's saves are gathered out in batches of at most this many bytes
_SLOW_SAVE_S = 20.0  # a part written later than this after its step gets one warning
_PRELOAD_KEEP_S = 300.0  # parts read ahead at startup and not asked for this long after go back
_READ_AHEAD = 8  # at most this many entries of one load job read at once (chunk order: an entry
# per 64 tokens), and at most one per two usable cores, each entry's frames in its own thread
# (on a 16-core GPU host 8 threads read 13.8 GB/s, 16 threads 12.3);
# with reader processes, one entry per process, up to _READ_AHEAD_HELPERS
_READ_AHEAD_HELPERS = 16


class _SaveCopy:
    """A save's pinned buffer (one entry's, or a batch's), given back to the pool once every
    entry in it was written (or given up) and no load reads it any more. Loads that read it
    give it back in the order their copies were issued (all on the engine's thread, on the one
    load stream), so the last copy's event is the one the buffer's next user waits for."""

    def __init__(self, cuda: CudaBlockTransfer, gathered: Gathered, entries: int) -> None:
        self._cuda, self.gathered = cuda, gathered
        self._left, self._readers = entries, 0
        self._last: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def written(self) -> None:
        """One entry's save is over (its hold was dropped first)."""
        with self._lock:
            self._left -= 1
            free = self._left == 0 and self._readers == 0
        if free:
            self._free()

    def read(self) -> None:
        with self._lock:
            self._readers += 1

    def done_reading(self, ready: torch.cuda.Event | None) -> None:
        with self._lock:
            self._readers -= 1
            self._last = ready if ready is not None else self._last
            free = self._left == 0 and self._readers == 0
        if free:
            self._free()

    def _free(self) -> None:
        buf = self.gathered.buffer
        if buf is not None:
            self._cuda.pool.release(buf, self._last if self._last is not None else self.gathered.done)


@dataclass
class _Hold:
    """An entry whose save is not durable yet, and the copy of its payload that save holds: on
    CUDA `host` (layer-major, in `copy`'s pinned buffer), on the byte path `views` (a layer each)."""

    nrows: int
    nbytes: int
    copy: _SaveCopy | None = None
    host: torch.Tensor | None = None
    views: list[memoryview] | None = None


@dataclass
class _HeldPart:
    """A part loaded from a pending save's copy (`_Hold`): no header, nothing read or verified."""

    nbytes: int
    views: list[memoryview]

    def segment_views(self) -> list[memoryview]:
        return self.views


@dataclass
class _HeldBuffer:
    """Where `_scatter_parts` copies a `_HeldPart` in from: the save's pinned buffer."""

    copy: _SaveCopy
    host: torch.Tensor
    ready: torch.cuda.Event | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        return self.host[:nbytes]


@dataclass
class _Preloaded:
    """A part read ahead at startup (`GalahadWorker._preload`), verified; on the CUDA path in
    `pinned`, a piece of the pinned arena, else in the part's own memory."""

    part: StoredPart
    pinned: PinnedBuffer | None


LoadedPart = StoredPart | _HeldPart  # what a load job reads: from the store, or from memory


def part_bytes(part: LoadedPart) -> int:
    """The payload bytes of a part a load job read (from the store or from memory)."""
    return part.nbytes if isinstance(part, _HeldPart) else part.header.payload_len


class LoadOutcome:
    """The parts read for a job (a usable prefix of its entries) and the first failure, if any."""

    def __init__(self, parts: list[LoadedPart], failed: EntryRef | None = None, reason: str = "",
                 seconds: float = 0.0) -> None:
        self.parts, self.failed, self.reason, self.seconds = parts, failed, reason, seconds


class GalahadWorker:
    def __init__(self, service: KVCacheService | None, rank: int, layout: RankLayout,
                 kv_cache_config: Any, block_size: int, *, perturb: str = "",
                 save_delay: tuple[float, str | None] = (0.0, None), pending_loads: bool = False,
                 preload_bytes: int | None = 0) -> None:
        self.service = service
        self.block_size = block_size
        self.rank = rank
        self.part = layout.part_of(rank)
        self.writes = self.part == rank
        self.kv_cache_config = kv_cache_config
        self.single_group = len(kv_cache_config.kv_cache_groups) == 1
        self.plan = StatePlan(service.namespace.groups) if service is not None else StatePlan(())
        self._state = [g.kind is GroupKind.STATE for g in self.plan.groups]
        self.blocks: KVBlocks | None = None
        self.perturb = perturb
        self.save_delay = save_delay  # a test hook (GALAHAD_TEST_SAVE_DELAY); 0 in production
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[LoadJob, Future[LoadOutcome]]] = {}
        self._acks: list[tuple[bytes, bool]] = []
        self._report = GalahadWorkerMetadata()
        self._invalid: set[int] = set()
        self.cuda: CudaBlockTransfer | None = None
        self._buffers: dict[int, PinnedBuffer | _HeldBuffer] = {}  # id(part) -> the pinned buffer it was read into
        self._streamed: set[int] = set()  # id(part) of parts already copied in as they were read
        self._warned_backlog = False
        self._warned_slow_save = False
        self._told_exit = False
        self._off = ""  # why this worker cannot cache (`cannot_cache`), told the scheduler side once
        self._off_told = False
        self._stopping = False  # `stop_saving`: the worker is shutting down
        self._step: tuple[int, float, Any] | None = None  # tokens, start time, start CUDA event
        self._timed_steps: list[tuple[int, Any, Any]] = []  # CUDA steps waiting for their events
        # Entries of one job read side by side (each on the service's frame pool): a pool of its
        # own, since async jobs already run on the service's I/O pool and wait for these.
        self._ahead = _ahead_for(service)
        self._entry_pool = (ThreadPoolExecutor(self._ahead, thread_name_prefix="galahad-entry")
                            if service is not None and self._ahead > 1 else None)
        # CUDA: a sync job's verified entries are copied in this many at a time (one scatter)
        self._batch = 2 * self._ahead
        self.pending_loads = pending_loads and self.writes  # loads from the copies saves hold
        self._held: dict[bytes, _Hold] = {}  # by key, under `_lock`
        self.preload_bytes = preload_bytes  # GALAHAD_PRELOAD_BYTES (None: auto, see `_start_preload`)
        self._arena_bytes = 0  # the CUDA path's pinned arena, reserved at registration
        self._preloaded: dict[bytes, _Preloaded] = {}  # parts read ahead at startup, by key, under `_lock`
        self._preload_until = 0.0  # monotonic; after it, parts read ahead and not asked for go back
        self._from_preload: set[int] = set()  # id(part) of loaded parts taken from `_preloaded`

    # -- registration ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.blocks = KVBlocks(kv_caches, self.kv_cache_config)
            first = self.blocks.layers()[0]
        except UnsupportedLayout as exc:
            self.blocks = None
            log.warning("[galahad] (worker rank %d) NOT CACHING: the KV cache layout cannot be copied "
                        "as whole blocks (%s); the scheduler stops offering hits and saving", self.rank, exc)
            self.cannot_cache(f"the KV cache layout cannot be copied as whole blocks ({exc})")
            return
        except Exception as exc:  # noqa: BLE001 - KV caches of a shape not foreseen: serve, uncached
            self.blocks = None
            log.warning("[galahad] (worker rank %d) NOT CACHING: cannot use the KV caches vLLM registered "
                        "(%s: %s); the scheduler stops offering hits and saving", self.rank,
                        type(exc).__name__, exc, exc_info=True)
            self.cannot_cache(f"cannot use the KV caches vLLM registered ({type(exc).__name__}: {exc})")
            return
        try:
            nbytes = self.blocks.num_blocks * sum(layer.page_bytes for layer in self.blocks.layers())
            # The CUDA path moves the same rows for every layer: one full-attention group only
            # (a sliding window or a state group stores other rows; the byte path serves them).
            full_only = all(g.kind is GroupKind.FULL for g in self.plan.groups)
            self.cuda = transfer_for(self.blocks.layers(), single_group=self.single_group and full_only,
                                     reserve_bytes=min(6 << 30, nbytes))
            self._arena_bytes = self.cuda.pool.total_bytes if self.cuda is not None else 0
            if self.cuda is not None and self.service is not None:
                # chunk order: a load job reads several entries at once and saves come
                # an entry at a time; their buffers are pinned now, not on the first requests
                chunking = self.service.chunking
                if chunking.order is PayloadOrder.CHUNK:
                    entry = self.cuda.payload_bytes(chunking.step // self.block_size)
                    count = 2 * self._ahead + self._batch
                    if not self._start_readers(entry, count):
                        self.cuda.pool.reserve(*[entry] * count)
                    if self.writes and self.cuda.can_gather_many():
                        self.cuda.pool.reserve(_SAVE_BATCH, _SAVE_BATCH)
        except Exception:  # noqa: BLE001 - no fast path: the byte path serves
            log.warning("[galahad] worker rank %d: no CUDA transfer path", self.rank, exc_info=True)
        pinned = "" if self.cuda is None else (
            f"; CUDA path, {self.cuda.pool.total_bytes >> 20} MiB of host memory pinned "
            f"(at most {self.cuda.pool.max_bytes >> 30} GiB)")
        log.info("[galahad] worker rank %d: %d layers, %d blocks of %d bytes per layer%s%s",
                 self.rank, len(self.blocks.layers()), self.blocks.num_blocks, first.page_bytes, pinned,
                 "" if self.writes else f" (holds the same KV as rank {self.part}: reads its part)")
        try:
            self._start_preload()
        except Exception:  # noqa: BLE001 - nothing read ahead: loads read the disk as always
            log.warning("[galahad] worker rank %d: reading ahead at startup (GALAHAD_PRELOAD_BYTES) cannot "
                        "start; loads read the disk", self.rank, exc_info=True)

    def cannot_cache(self, reason: str) -> None:
        """This worker can neither load nor save (its store did not open, its KV cache layout
        cannot be copied, or its licence was refused while serving): its handshake and its next
        report say so (`connector.py`), and the scheduler side, which may cache, stops offering
        hits this rank could only fail and shipping saves it could only drop. From now on its
        saves are dropped (acknowledged as not written); loads already shipped still run."""
        self._off = reason

    @property
    def off(self) -> str:
        """Why this worker cannot cache ("" when it can)."""
        return self._off

    # -- reading ahead at startup ---------------------------------------------------------------

    def _start_preload(self) -> None:
        """GALAHAD_PRELOAD_BYTES: read this rank's parts of the store's most recently used entries
        into memory, on a thread of their own while the engine finishes starting, so that the
        first requests after a restart load them with no read of the disk (`_take_preloaded`).

        `auto` (None, the default): on the CUDA path as much as the pinned arena reserved at
        registration holds (what loads copy through anyway: no memory is added); on the byte
        path nothing. On the CUDA path never more than that arena: it is taken here, in one
        piece, on the engine's thread, and the reading thread only cuts it up (no CUDA call
        there: vLLM may be capturing CUDA graphs meanwhile). Off for a perturbing test run."""
        service, cuda = self.service, self.cuda
        budget = self.preload_bytes
        if budget is None:
            budget = self._arena_bytes if cuda is not None else 0
        if service is None or self.blocks is None or self.perturb or budget <= 0:
            return
        block = None
        if cuda is not None:
            if self._arena_bytes <= 0:  # no arena was reserved: nothing to read into
                return
            block = cuda.pool.acquire(min(budget, self._arena_bytes), pin=False)
            if block is None or block.arena is None:
                if block is not None:
                    cuda.pool.release(block)
                log.info("[galahad] worker rank %d: nothing read ahead at startup (no free pinned arena)", self.rank)
                return
            budget = min(budget, block.capacity)
        else:  # ordinary memory: never more than half of what the host has available now
            room = _available_memory() // 2
            if room and budget > room:
                log.info("[galahad] worker rank %d: GALAHAD_PRELOAD_BYTES=%d is more than half the memory "
                         "available (%d MiB); reading ahead at most %d MiB", self.rank, budget,
                         2 * room >> 20, room >> 20)
                budget = room
        threading.Thread(target=self._preload, args=(service, budget, block), name="galahad-preload",
                         daemon=True).start()

    def _preload(self, service: KVCacheService, budget: int, block: PinnedBuffer | None) -> None:
        """The reading thread of `_start_preload`: each part read and verified as any load is
        (`load_part`: a damaged one is refused, counted and quarantined), least recent first, so
        the reads leave the entries' recency in the order it was. What is left of `block` goes
        back to the pool at the end."""
        t0, nbytes, done = time.monotonic(), 0, 0
        rest = block
        try:
            cost = PinnedPool.footprint if block is not None else None
            for key, size in reversed(service.recent_parts(self.rank, budget, cost=cost)):
                if self._stopping:
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
                    part = service.load_part(key, self.rank, fail=False, max_bytes=size,
                                             out=pinned.memoryview(size) if pinned is not None else None)
                except BaseException:
                    self._release_piece(pinned)  # its piece of the arena
                    raise
                if part is None:  # refused (counted), or gone meanwhile
                    self._release_piece(pinned)
                    continue
                with self._lock:
                    self._preloaded[key.raw] = _Preloaded(part, pinned)
                nbytes += part.header.payload_len
                done += 1
        except Exception:  # noqa: BLE001 - a thread boundary: what was read ahead is kept
            log.warning("[galahad] worker rank %d: reading ahead at startup stopped", self.rank, exc_info=True)
        finally:
            self._release_piece(rest)
            self._preload_until = time.monotonic() + _PRELOAD_KEEP_S
        if done:
            service.count(preloaded=done)
            log.info("[galahad] worker rank %d: read ahead %d of the store's most recently used entries "
                     "(%.2f GB) in %.2f s; their first loads read nothing from the disk (GALAHAD_PRELOAD_BYTES)",
                     self.rank, done, nbytes / 1e9, time.monotonic() - t0)

    def _release_piece(self, piece: PinnedBuffer | None) -> None:
        """A piece of the arena the read-ahead held goes back to the pool (None: nothing held)."""
        if piece is not None and self.cuda is not None:
            self.cuda.pool.release(piece)

    def _take_preloaded(self, entry: EntryRef) -> StoredPart | None:
        """The entry's part as read ahead at startup, if it was and fits the entry (else it goes
        back and the entry is read from the disk, as any other); counted `preloaded_loads`."""
        with self._lock:
            pre = self._preloaded.pop(entry.key, None)
        if pre is None or self.blocks is None:
            return None
        nrows = (entry.end - entry.start) // self.block_size
        problem = self._check(entry, pre.part, self.blocks)
        if not problem and pre.pinned is not None and self.cuda is not None:
            problem = "" if self.cuda.payload_bytes(nrows) == pre.part.header.payload_len else "size"
        if problem:
            self._release_piece(pre.pinned)
            return None
        if pre.pinned is not None:
            self._buffers[id(pre.part)] = pre.pinned
        self._from_preload.add(id(pre.part))
        if self.service is not None:
            self.service.count(preloaded_loads=1)
        return pre.part

    def _acquire(self, cuda: CudaBlockTransfer, nbytes: int, shared: bool) -> PinnedBuffer | None:
        """`cuda.pool.acquire` for a save or a load. While parts read ahead at startup hold the
        pinned arena, they go back first, least recently used first (the load of each then reads
        the disk, as without the read-ahead), before a new buffer is pinned on the engine's
        thread: pinning 320 MiB took 163 ms there on the H200, six times a 2k-token load."""
        while self._preloaded:
            buf = cuda.pool.acquire(nbytes, pin=False, shared=shared)
            if buf is not None:
                return buf
            with self._lock:
                key = next(iter(self._preloaded), None)  # read ahead in recency order, oldest first
                pre = self._preloaded.pop(key) if key is not None else None
            if pre is not None:
                self._release_piece(pre.pinned)
        return cuda.pool.acquire(nbytes, shared=shared)

    def _expire_preloaded(self, now: float | None = None) -> None:
        """Parts read ahead that no request asked for within `_PRELOAD_KEEP_S` of the read-ahead
        (or all of them, at close: `now` None) give their memory back."""
        if not self._preloaded or (now is not None and (not self._preload_until or now < self._preload_until)):
            return
        with self._lock:
            gone, self._preloaded = list(self._preloaded.values()), {}
        for pre in gone:
            self._release_piece(pre.pinned)
        if now is not None and gone:
            log.info("[galahad] worker rank %d: %d entries read ahead at startup were not asked for within "
                     "%.0f s; their memory goes back", self.rank, len(gone), _PRELOAD_KEEP_S)

    def _start_readers(self, entry: int, count: int) -> bool:
        """Reader processes (`bootstrap.reader_processes_for`) reading loads into a shared pinned
        region that holds the `count` load buffers of `entry` bytes. False: no region (reserve
        plain buffers). Helpers that do not start leave the region as plain buffers."""
        service, cuda = self.service, self.cuda
        if service is None or cuda is None or not service.reader_processes or service.helper_recipe is None:
            return False
        region = cuda.pool.reserve_shared(entry, count)
        if region is None:
            return False
        try:
            service.attach_readers(ReaderPool(region, service.helper_recipe, service.reader_processes))
        except Exception:  # noqa: BLE001 - no helpers: this process reads, as without them
            log.warning("[galahad] worker rank %d: reader processes did not start; loads are read in "
                        "this process", self.rank, exc_info=True)
            return True
        log.info("[galahad] worker rank %d: %d reader processes read loads "
                 "into a %d MiB shared pinned region", self.rank, service.reader_processes, region.size >> 20)
        return True

    # -- step timing (the engine's prefill figures for load-or-recompute) ----------------------

    def step_started(self, meta: GalahadMetadata) -> None:
        """Time this forward step if it computes tokens and loads nothing (rank 0 reports)."""
        self._step = None
        if self.rank != 0 or meta.step_tokens <= 0 or meta.loads or self.blocks is None:
            return
        event = None
        if self.cuda is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._step = (meta.step_tokens, time.perf_counter(), event)

    def step_ended(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        tokens, t0, start = step
        if start is None:
            self._report.steps.append((tokens, time.perf_counter() - t0))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timed_steps.append((tokens, start, end))

    def _resolve_steps(self) -> None:
        waiting = []
        for tokens, start, end in self._timed_steps:
            if end.query():
                self._report.steps.append((tokens, start.elapsed_time(end) / 1e3))
            else:
                waiting.append((tokens, start, end))
        self._timed_steps = waiting[-16:]

    # -- saving ---------------------------------------------------------------------------------

    def save(self, meta: GalahadMetadata) -> None:
        """Copy every save job's blocks out now; seal and write them on the I/O pool.

        On CUDA, a step's entries (chunk order: one per 64 tokens) are copied out together, up to
        `_SAVE_BATCH` bytes at a time (`gather_many`): the engine thread launches two kernels a
        layer per batch, not a layer's copy per entry."""
        if not self.writes:
            return
        entries = [entry for job in meta.saves for entry in job.entries]
        if self._off:  # `cannot_cache`: nothing more is written, and nothing is left waiting
            for entry in entries:
                self._ack(entry.key, False)
            return
        for batch in self._save_batches(entries):
            try:
                if len(batch) == 1:
                    self._save_entry(batch[0])
                else:
                    self._save_together(batch)
            except Exception:  # noqa: BLE001 - a failed save is a future miss
                log.warning("[galahad] save of %s failed", batch[0].key.hex()[:16], exc_info=True)
                for entry in batch:
                    self._unhold(entry.key)
                    self._ack(entry.key, False)

    def _save_batches(self, entries: list[EntryRef]) -> list[list[EntryRef]]:
        """The entries in consecutive batches of at most `_SAVE_BATCH` bytes (one each without a
        CUDA path that gathers many)."""
        cuda = self.cuda
        if cuda is None or self.service is None or self.blocks is None or not cuda.can_gather_many():
            return [[entry] for entry in entries]
        out: list[list[EntryRef]] = []
        size = 0
        for entry in entries:
            n = cuda.payload_bytes(len(entry.blocks[0]))
            if out and size + n <= _SAVE_BATCH:
                out[-1].append(entry)
                size += n
            else:
                out.append([entry])
                size = n
        return out

    def _save_together(self, batch: list[EntryRef]) -> None:
        """Gather a batch of entries into one pinned buffer; each is sealed and written on its own
        save thread, and the buffer goes back to the pool once the last of them is written."""
        service, blocks, cuda = self.service, self.blocks, self.cuda
        if service is None or blocks is None or cuda is None:  # _save_batches made one-entry batches
            raise RuntimeError("no CUDA path to gather a batch of saves")
        sizes = [len(entry.blocks[0]) for entry in batch]
        buf = self._acquire(cuda, cuda.payload_bytes(sum(sizes)), False)
        if buf is None:  # the pool is at its cap: see _save_entry_cuda
            for entry in batch:
                self._skip_save(entry.key, service)
            return
        try:
            gathered = cuda.gather_many([entry.blocks for entry in batch], buf)
        except BaseException:
            cuda.pool.release(buf)  # nothing was queued into it
            raise
        copy = _SaveCopy(cuda, gathered, len(batch))  # given back once every entry is written
        offset = 0
        for entry, nrows in zip(batch, sizes):
            segments = [_segment(layer, nrows) for layer in blocks.layers()]
            n = cuda.payload_bytes(nrows)
            self._hold(entry.key, _Hold(nrows, n, copy, gathered.host[offset : offset + n]))

            def payload(at: int = offset, n: int = nrows) -> list[memoryview]:
                gathered.wait()
                return gathered.views(cuda.segment_bytes(n), at)

            self._submit_write(service, entry, segments, payload, functools.partial(self._written, entry.key, copy))
            offset += n

    def _save_entry(self, entry: EntryRef) -> None:
        service, blocks = self.service, self.blocks
        if service is None or blocks is None:
            self._ack(entry.key, False)
            return
        if self.cuda is not None:
            self._save_entry_cuda(entry, service, blocks, self.cuda)
            return
        segments, rows = [], []
        for layer in blocks.layers():
            ids = entry.blocks[layer.group]
            rows.append(blocks.gather(layer, ids))
            segments.append(_segment(layer, len(ids), self._state[layer.group]))
        views = [r.numpy().reshape(-1).data for r in rows]
        if self.single_group:  # several groups store per-group rows: loaded from the disk only
            self._hold(entry.key, _Hold(len(entry.blocks[0]), sum(v.nbytes for v in views), views=views))

        def done() -> None:
            self._written(entry.key, None)
            rows.clear()

        self._submit_write(service, entry, segments, lambda: views, done)

    def _save_entry_cuda(self, entry: EntryRef, service: KVCacheService, blocks: KVBlocks,
                         cuda: CudaBlockTransfer) -> None:
        """Gather on the save stream now; seal and write on the I/O pool once it reached the host."""
        nrows = len(entry.blocks[0])
        segments = [_segment(layer, nrows) for layer in blocks.layers()]
        buf = self._acquire(cuda, cuda.payload_bytes(nrows), False)
        if buf is None:
            # The pinned pool is at its cap, every buffer holding a save not yet written: the
            # disk writes slower than the engine makes KV. Skip this save rather than stall the
            # forward pass on a copy into ordinary memory.
            self._skip_save(entry.key, service)
            return
        gathered = cuda.gather(entry.blocks, buf)
        copy = _SaveCopy(cuda, gathered, 1)
        self._hold(entry.key, _Hold(nrows, gathered.nbytes, copy, gathered.host))

        def payload() -> list[memoryview]:
            gathered.wait()
            return gathered.views(cuda.segment_bytes(nrows))

        self._submit_write(service, entry, segments, payload, functools.partial(self._written, entry.key, copy))

    def _submit_write(self, service: KVCacheService, entry: EntryRef, segments: list[SegmentSpec],
                      payload: Callable[[], Sequence[Any]], done: Callable[[], None]) -> None:
        """Seal and write one part on the save threads, acknowledge it, then `done()` (frees the
        copy); `payload()` gives its segments' bytes there."""
        key, span = ChainKey(entry.key), _span(entry)
        shipped = time.monotonic()

        def write() -> None:
            ok = False
            try:
                if self._stopping or _exiting():
                    self._drop_at_exit(service)
                    return
                seconds, gate = self.save_delay
                if seconds and (gate is None or os.path.exists(gate)):
                    time.sleep(seconds)
                service.yield_to_loads()  # a load running now goes first, a bounded while
                # False also when the part exists already (another request wrote it): durable
                ok = service.save_part(key, span, self.rank, segments, payload()) or service.has_part(key, self.rank)
            except Exception:  # noqa: BLE001 - thread boundary
                if self._stopping or _exiting():  # torn down under it: no longer a fault to report
                    log.debug("[galahad] writing %s stopped by the exit", entry.key.hex()[:16], exc_info=True)
                else:
                    log.warning("[galahad] writing %s failed", entry.key.hex()[:16], exc_info=True)
            finally:
                self._ack(entry.key, ok)
                done()
                self._note_slow_save(entry.key, time.monotonic() - shipped)

        service.submit_save(write)

    def _hold(self, key: bytes, hold: _Hold) -> None:
        """Keep `hold` as the copy loads of `key` use until its save is over; reported `held`."""
        if not self.pending_loads:
            return
        with self._lock:
            self._held[key] = hold
        self._report.held.setdefault(key, []).append(self.rank)

    def _unhold(self, key: bytes) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _written(self, key: bytes, copy: _SaveCopy | None) -> None:
        """An entry's save is over (durable, or given up): loads read the disk from now on, and
        the save's copy goes back once no load reads it."""
        self._unhold(key)
        if copy is not None:
            copy.written()

    def _take_held(self, entry: EntryRef) -> _HeldPart | None:
        """The entry as the copy of its pending save holds it, if this worker holds one of its
        span; a CUDA copy is kept from going back to the pool until the load gives it back."""
        nrows = (entry.end - entry.start) // self.block_size
        with self._lock:
            hold = self._held.get(entry.key)
            if hold is None or hold.nrows != nrows:
                return None
            if hold.copy is not None:
                hold.copy.read()
        if hold.copy is not None and hold.host is not None:
            hold.copy.gathered.wait()  # its copy to the host (queued in an earlier step) is done
            part = _HeldPart(hold.nbytes, [])
            self._buffers[id(part)] = _HeldBuffer(hold.copy, hold.host)
        else:
            part = _HeldPart(hold.nbytes, list(hold.views or ()))
        if self.service is not None:
            self.service.count(held_loads=1)
        return part

    def _note_slow_save(self, key: bytes, seconds: float) -> None:
        """One warning the first time a part took longer than the scheduler side waits before it
        asks the store (its entry is then committed from the disk, or given up)."""
        if seconds > _SLOW_SAVE_S and not self._warned_slow_save:
            self._warned_slow_save = True
            log.warning("[galahad] worker rank %d: writing the part of %s took %.0f s after its step "
                        "(disk or save threads overloaded); it was acknowledged late", self.rank,
                        key.hex()[:16], seconds)

    def stop_saving(self) -> None:
        """At shutdown: saves queued and not yet started are dropped (`_drop_at_exit`); one
        being written finishes. Parts read ahead at startup and not asked for go back."""
        self._stopping = True
        self._expire_preloaded()

    def _drop_at_exit(self, service: KVCacheService) -> None:
        """A save not started when the worker shut down or the process began to exit is not
        written: its entry could only be committed by the scheduler's next steps, and there are
        none. Counted `saves_skipped`; said once."""
        service.count(saves_skipped=1)
        with self._lock:
            first, self._told_exit = not self._told_exit, True
        if first:
            log.info("[galahad] worker rank %d: stopping; saves not yet written are dropped (counted "
                     "saves_skipped; what is already stored is kept)", self.rank)

    def _skip_save(self, key: bytes, service: KVCacheService) -> None:
        service.count(saves_skipped=1)
        if not self._warned_backlog:
            self._warned_backlog = True
            log.warning("[galahad] worker rank %d: saves skipped while the disk catches up (every "
                        "pinned buffer holds a save not yet written); counted as saves_skipped",
                        self.rank)
        self._ack(key, False)

    def _ack(self, key: bytes, ok: bool) -> None:
        with self._lock:
            self._acks.append((key, ok))

    # -- loading --------------------------------------------------------------------------------

    def start_load(self, meta: GalahadMetadata) -> None:
        """Sync jobs load now; async jobs are queued and always reported (failed or not) later.

        A sync job with one KV cache group copies each entry in as soon as it and every entry
        before it verified, while the next ones are still read (a failure later in the job still
        leaves a valid prefix: vLLM recomputes only the blocks after it). Whatever goes wrong here,
        every job is still reported, failed if it did not finish: vLLM never computes on blocks
        a load was meant to fill and did not."""
        try:
            if self._preloaded:
                self._expire_preloaded(time.monotonic())
            self._start_load(meta)
        except Exception:  # noqa: BLE001 - a bug or a broken runtime: recompute, never stale KV
            log.warning("[galahad] starting this step's loads failed; they are recomputed", exc_info=True)
            self._fail_unreported(meta)

    def _fail_unreported(self, meta: GalahadMetadata) -> None:
        """Report every load job of `meta` not reported (sync) or queued (async) yet as failed
        from its first entry: all its blocks are recomputed."""
        for job in meta.loads:
            first = job.entries[0] if job.entries else None
            if job.async_load:
                if job.req_id not in self._pending:
                    done: Future[LoadOutcome] = Future()
                    done.set_result(LoadOutcome([], first, "error"))
                    self._pending[job.req_id] = (job, done)
                continue
            if job.req_id in self._report.loaded:
                continue
            try:
                self._finish(job, LoadOutcome([], first, "error"))
            except Exception:  # noqa: BLE001 - at least vLLM recomputes every block of the job
                for entry in job.entries:
                    self._invalid.update(entry.blocks[0])
                self._report.loaded.setdefault(job.req_id, []).append((self.rank, first.key if first else b"broken"))

    def _start_load(self, meta: GalahadMetadata) -> None:
        for job in meta.loads:
            if job.async_load:
                self._pending[job.req_id] = (job, self._submit_read(job))
            elif self.single_group:
                placer = _Placer(self, self._batch if self.cuda is not None else 1)
                outcome = self._read(job, placer)
                self._finish(job, outcome, placed=placer.placed)
            else:
                self._finish(job, self._read(job))

    def _submit_read(self, job: LoadJob) -> Future[LoadOutcome]:
        try:
            if self.service is not None:
                return self.service.submit(self._read, job)
        except Exception:  # noqa: BLE001 - e.g. the pool is shut down: the job fails, reported
            log.warning("[galahad] cannot queue the load of %s", job.req_id, exc_info=True)
        done: Future[LoadOutcome] = Future()
        done.set_result(LoadOutcome([], job.entries[0] if job.entries else None, "disabled")
                        if self.service is not None else self._read(job))
        return done

    def _read(self, job: LoadJob, placer: _Placer | None = None) -> LoadOutcome:
        """Read and verify every entry of `job` in order; stop at the first failure.

        Several entries (chunk order) are read up to `self._ahead` at a time, each entry's frames
        in its own thread. `placer`, when given, takes each part in order as soon as it verified and copies
        them in a batch at a time; a part it took is not in the outcome's `parts`, and a batch it
        could not copy in fails the job at that batch's first entry."""
        if job.broken or not job.entries:
            return LoadOutcome([], None, "broken")
        if self.service is None:
            return self._read_job(job, placer)
        with self.service.loading():  # saves starting meanwhile wait for it (`galahad.app.priority`)
            return self._read_job(job, placer)

    def _read_job(self, job: LoadJob, placer: _Placer | None) -> LoadOutcome:
        parts: list[LoadedPart] = []
        t0 = time.perf_counter()
        # GALAHAD_FAULT_LOAD_RATE (test only) fails that share of load jobs, at one of its entries
        fail_at = random.randrange(len(job.entries)) if self.service and self.service.draw_fault() else -1
        # one entry read inside the step (layer order): copied on layer by layer as it verifies
        stream = placer is not None and len(job.entries) == 1 and self.cuda is not None
        results = self._read_ahead(job.entries, fail_at, stream)
        try:
            failed = self._take_parts(job, results, parts, placer)
        finally:
            results.close()  # reads started beyond a failure: waited for, buffers given back
        return self._outcome(failed, parts, placer, t0)

    @staticmethod
    def _take_parts(job: LoadJob, results: Iterator[tuple[str, LoadedPart | None]], parts: list[LoadedPart],
                    placer: _Placer | None) -> tuple[EntryRef | None, str]:
        """Each entry's read result in order, into `placer` (or `parts`), up to the first failure:
        (the entry the job fails at, why), or (None, "")."""
        for entry, (reason, part) in zip(job.entries, results):
            if part is None:
                return entry, reason
            if placer is None:
                parts.append(part)
                continue
            unplaced = placer.add(entry, part)
            if unplaced is not None:  # the copy failed: nothing from there on is valid
                return unplaced, "error"
        return None, ""

    @staticmethod
    def _outcome(failed: tuple[EntryRef | None, str], parts: list[LoadedPart], placer: _Placer | None,
                 t0: float) -> LoadOutcome:
        if placer is not None:  # the verified prefix still waiting for its batch goes in now
            unplaced = placer.flush()
            if unplaced is not None:
                failed = (unplaced, "error")
        if failed[0] is not None:
            return LoadOutcome(parts, failed[0], failed[1])
        return LoadOutcome(parts, seconds=time.perf_counter() - t0)

    def _read_ahead(self, entries: tuple[EntryRef, ...], fail_at: int = -1,
                    stream: bool = False) -> Generator[tuple[str, LoadedPart | None], None, None]:
        """`_read_one` of each entry in order; with several, `self._ahead` read at once and as
        many more queued behind them, so the threads go on reading while the caller copies a
        batch in (the pinned buffers reserved at registration cover both and a batch)."""
        if len(entries) == 1 or self._entry_pool is None:
            for i, entry in enumerate(entries):
                yield self._read_one(entry, i == fail_at, stream)
            return
        reads = _EntryStream(self, list(entries), {fail_at} if fail_at >= 0 else set())
        try:
            yield from reads.take(len(entries))
        finally:
            reads.close()  # not taken (an earlier entry failed): never used, buffers given back

    def _read_one(self, entry: EntryRef, fail: bool = False, stream: bool = False,
                  fan_out: bool = True) -> tuple[str, LoadedPart | None]:
        """(reason, None) when the entry cannot be used, ("", part) when it verified."""
        got: list[LoadedPart] = []
        try:
            reason = self._read_entry(entry, got, fail, stream, fan_out)
        except Exception:  # noqa: BLE001 - thread boundary: a failed read is a miss
            log.warning("[galahad] reading %s failed", entry.key.hex()[:16], exc_info=True)
            reason = "error"
            if self.service is not None:
                self.service.count_refused(MissReason.ERROR)
        if reason or not got:
            return reason or "error", None
        return "", got[0]

    def _read_entry(self, entry: EntryRef, parts: list[LoadedPart], fail: bool = False,
                    stream: bool = False, fan_out: bool = True) -> str:
        """Read and verify one entry into `parts`; "" or the reason it cannot be used.

        With `stream` (CUDA, on the forward's thread), the entry is copied into its blocks layer
        by layer as its frames verify (`CudaBlockTransfer.stream_in`), overlapping the read with
        the host-to-device copies; the part is then already in place (`self._streamed`)."""
        service, blocks = self.service, self.blocks
        if service is None or blocks is None:
            return "disabled"
        if self.pending_loads and not fail and not self.perturb:
            held = self._take_held(entry)
            if held is not None:
                parts.append(held)
                return ""
        if self._preloaded and not fail and not self.perturb:
            preloaded = self._take_preloaded(entry)
            if preloaded is not None:
                parts.append(preloaded)
                return ""
        cuda, pinned, streamer = self.cuda, None, None
        if cuda is not None and not self.perturb:  # read straight into a reused pinned buffer
            nrows = (entry.end - entry.start) // self.block_size
            nbytes = cuda.payload_bytes(nrows)
            pinned = self._acquire(cuda, nbytes, True)
            if pinned is not None and stream:
                streamer = cuda.stream_in(entry.blocks, pinned.view(nbytes), nrows, entry.first_row(0))
        try:
            if cuda is not None and pinned is not None:
                part = service.load_part(ChainKey(entry.key), self.rank, out=pinned.memoryview(nbytes),
                                         fail=fail, fan_out=fan_out,
                                         progress=streamer.advance if streamer is not None else None,
                                         region_offset=pinned.region_offset if streamer is None else None)
            else:  # a part larger than the entry's blocks is refused before its claim is read
                part = service.load_part(ChainKey(entry.key), self.rank, fail=fail, fan_out=fan_out,
                                         max_bytes=self._entry_bytes(entry.start, entry.end, blocks))
        except BaseException:
            if cuda is not None and pinned is not None:  # copies made so far: waited for, as below
                cuda.pool.release(pinned, streamer.abandon() if streamer is not None else None)
            raise
        problem = "" if part is None else self._check(entry, part, blocks)
        if streamer is not None and pinned is not None:
            # copies already made wait for the forward pass, whatever the outcome: a failed load
            # is recomputed into these blocks after them, never overwritten by them
            ready = streamer.abandon() if part is None or problem else streamer.finish()
            pinned.ready = ready if ready is not None else pinned.ready
            if part is not None and not problem:
                self._streamed.add(id(part))
        if part is None:
            if cuda is not None and pinned is not None:
                cuda.pool.release(pinned)
            return "refused"
        if pinned is not None:
            self._buffers[id(part)] = pinned
        if problem:
            self._return_buffers([part])
            log.warning("[galahad] entry %s does not fit this engine (%s); quarantined",
                        entry.key.hex()[:16], problem)
            service.quarantine(ChainKey(entry.key), "shape")
            return "shape"
        parts.append(part)
        return ""

    def _entry_bytes(self, start: int, end: int, blocks: KVBlocks) -> int:
        """The payload bytes of this rank's part of an entry of tokens [start, end)."""
        nrows = [len(p.blocks) for p in self.plan.parts(start, end)]
        return sum(nrows[layer.group] * layer.page_bytes for layer in blocks.layers())

    def _check(self, entry: EntryRef, part: StoredPart, blocks: KVBlocks) -> str:
        layers = blocks.layers()
        segs = part.header.segments
        if len(segs) != len(layers):
            return f"{len(segs)} segments for {len(layers)} layers"
        nrows = [len(p.blocks) for p in self.plan.parts(entry.start, entry.end)]
        for seg, layer in zip(segs, layers):
            if seg.group != layer.group or seg.nbytes != nrows[layer.group] * layer.page_bytes:
                return f"segment {seg.group}/{seg.layer} holds {seg.nbytes} bytes"
        return ""

    def _finish(self, job: LoadJob, outcome: LoadOutcome, *, placed: Sequence[LoadedPart] = ()) -> bool:
        """Copy the verified prefix in (after the parts `place` already copied in); record failures.

        Returns True when the request must be reported failed as a whole (`failed_recving`):
        several KV cache groups (vLLM refuses block-level errors then) or a job without blocks.
        """
        if job.broken or not job.entries:
            self._report.loaded.setdefault(job.req_id, []).append((self.rank, b"broken"))
            return True
        good = len(placed) + len(outcome.parts)
        if outcome.failed is not None and not self.single_group:
            good = 0  # several groups: the request is recomputed whole, nothing is copied in
        t0 = time.perf_counter()
        nbytes = sum(part_bytes(part) for part in (*placed, *outcome.parts))
        try:
            self._scatter_parts(list(zip(job.entries[len(placed) : good], outcome.parts)))
        except Exception:  # noqa: BLE001 - treat as a failure of the whole job
            log.warning("[galahad] copying a load into the KV cache failed", exc_info=True)
            good, outcome.reason = 0, "error"
            outcome.failed = job.entries[0]
        finally:
            self._return_buffers(outcome.parts)
        failed = outcome.failed
        held = any(isinstance(part, _HeldPart) or id(part) in self._from_preload for part in (*placed, *outcome.parts))
        if self._from_preload:
            self._from_preload.difference_update(id(part) for part in (*placed, *outcome.parts))
        if failed is None and nbytes and not held:  # a load from memory says nothing of the store's rate
            self._report.timings[job.req_id] = (nbytes, outcome.seconds + time.perf_counter() - t0)
        if failed is not None:
            for entry in job.entries[good:]:
                self._invalid.update(entry.blocks[0])
            self._report.failed_keys[failed.key] = outcome.reason
        self._report.loaded.setdefault(job.req_id, []).append(
            (self.rank, None if failed is None else failed.key))
        return failed is not None and not self.single_group

    def _return_buffers(self, parts: list[LoadedPart]) -> None:
        for part in parts:
            self._streamed.discard(id(part))
            pinned = self._buffers.pop(id(part), None)
            if isinstance(pinned, _HeldBuffer):
                pinned.copy.done_reading(pinned.ready)  # a save's copy: back once written too
            elif pinned is not None and self.cuda is not None:
                self.cuda.pool.release(pinned)  # keeps the event of the copy still reading it

    def _scatter_parts(self, items: Sequence[tuple[EntryRef, LoadedPart]]) -> None:
        """Copy verified parts into their blocks. CUDA: those read into pinned buffers all at once
        on the load stream (`scatter_many`: a few kernels a layer for the whole batch, not a
        layer's copy per entry), the compute stream made to wait for it; each buffer is reused
        only after that copy completed. The rest one at a time (`_scatter`)."""
        cuda, batch, buffers = self.cuda, [], []
        for entry, part in items:
            if id(part) in self._streamed:  # copied in while it was read
                self._streamed.discard(id(part))
                continue
            pinned = self._buffers.get(id(part))
            if cuda is None or pinned is None:
                self._scatter(entry, part)
                continue
            nrows = (entry.end - entry.start) // self.block_size
            batch.append(Piece(entry.blocks, pinned.view(part_bytes(part)), nrows, entry.first_row(0)))
            buffers.append(pinned)
        if cuda is not None and batch:
            done = cuda.scatter_many(batch)
            for pinned in buffers:
                pinned.ready = done

    def _scatter(self, entry: EntryRef, part: LoadedPart) -> None:
        """Copy a verified part into its blocks by layer (the byte path: no pinned buffer)."""
        blocks = self.blocks
        if blocks is None:
            raise RuntimeError("no KV caches registered")
        for layer, view in zip(blocks.layers(), part.segment_views()):
            rows = torch.frombuffer(view, dtype=torch.uint8).view(-1, layer.page_bytes)
            ids = entry.blocks[layer.group]
            if not ids:
                continue  # this entry holds nothing this load needs of the group
            first = entry.first_row(layer.group)
            rows = rows[first : first + len(ids)]
            if self.perturb in ("all", self.plan.groups[layer.group].kind.value):
                rows = KVBlocks.perturb(layer, rows)
            blocks.scatter(layer, ids, rows)

    # -- reporting ------------------------------------------------------------------------------

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) for async jobs whose read completed."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, (job, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            try:
                outcome = fut.result()
            except BaseException:  # noqa: BLE001 - a cancelled or crashed read is a failed load
                outcome = LoadOutcome([], job.entries[0], "error")
            del self._pending[req_id]
            try:
                if self._finish(job, outcome):
                    failed.add(req_id)
            except Exception:  # noqa: BLE001 - a request nobody reports would wait for ever
                log.warning("[galahad] finishing request %s's load failed; it is recomputed whole", req_id,
                            exc_info=True)
                failed.add(req_id)
            finished.add(req_id)
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        if not self.single_group:  # vLLM refuses block-level errors for several groups
            self._invalid.clear()
            return set()
        out, self._invalid = self._invalid, set()
        return out

    def take_report(self) -> GalahadWorkerMetadata | None:
        with self._lock:
            acks, self._acks = self._acks, []
        if self._timed_steps:
            self._resolve_steps()
        report, self._report = self._report, GalahadWorkerMetadata()
        for key, ok in acks:
            report.saved.setdefault(key, []).append((self.rank, ok))
        if self._off and not self._off_told:
            self._off_told = True
            report.off[self.rank] = self._off
        return report if report else None

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Let queued reads finish (used at shutdown)."""
        for _job, fut in list(self._pending.values()):
            try:
                fut.result(timeout=timeout)
            except BaseException:  # noqa: BLE001
                pass


def _span(entry: EntryRef) -> Span:
    return Span(entry.start, entry.end)


def _segment(layer: LayerView, nrows: int, state: bool = False) -> SegmentSpec:
    """The segment of one layer (kind 1 for a state group): its logical block shape, or raw bytes
    when pages are padded."""
    elem = torch.empty(0, dtype=layer.dtype).element_size()
    kind = 1 if state else 0
    if math.prod(layer.block_shape) * elem == layer.page_bytes:
        return SegmentSpec(layer.group, layer.index, kind, layer.dtype_name, (nrows, *layer.block_shape))
    return SegmentSpec(layer.group, layer.index, kind, "uint8", (nrows, layer.page_bytes))


class _Placer:
    """A sync job's verified parts, copied into the KV cache `batch` at a time, in order."""

    def __init__(self, worker: GalahadWorker, batch: int) -> None:
        self._worker = worker
        self._batch = max(1, batch)
        self._pending: list[tuple[EntryRef, LoadedPart]] = []
        self.placed: list[LoadedPart] = []

    def add(self, entry: EntryRef, part: LoadedPart) -> EntryRef | None:
        """Take the next part; copies the batch in once full. Returns the entry the job fails
        at when that copy failed (None: all well)."""
        self._pending.append((entry, part))
        return self.flush() if len(self._pending) >= self._batch else None

    def flush(self) -> EntryRef | None:
        """Copy the parts taken so far in; their pinned buffers go back (reused once the copy is
        done). Returns the batch's first entry when the copy failed: none of it counts as placed."""
        batch, self._pending = self._pending, []
        if not batch:
            return None
        try:
            self._worker._scatter_parts(batch)
        except Exception:  # noqa: BLE001 - the copy failed: nothing from this batch on is valid
            log.warning("[galahad] copying a load into the KV cache failed", exc_info=True)
            return batch[0][0]
        finally:
            self._worker._return_buffers([part for _entry, part in batch])
        self.placed.extend(part for _entry, part in batch)
        return None


class _EntryStream:
    """A load job's entries read in order (`_read_ahead`), `2 * worker._ahead` in flight at a
    time on the worker's entry threads; `faults`: indices read as failed (test only)."""

    def __init__(self, worker: GalahadWorker, entries: list[EntryRef], faults: set[int]) -> None:
        if worker._entry_pool is None:
            raise RuntimeError("a stream of entries needs the worker's entry threads")
        self._worker, self._pool = worker, worker._entry_pool
        self._queue = collections.deque(enumerate(entries))
        self._faults = faults
        self._flight: collections.deque[tuple[int, Future[tuple[str, LoadedPart | None]]]] = collections.deque()

    def _fill(self) -> None:
        while self._queue and len(self._flight) < 2 * self._worker._ahead:
            i, entry = self._queue.popleft()  # side by side: each entry's frames in its own thread
            self._flight.append((i, self._pool.submit(self._worker._read_one, entry, i in self._faults, False, False)))

    def next(self) -> tuple[str, LoadedPart | None]:
        """The next entry's (reason, part), as `GalahadWorker._read_one` gives it."""
        self._fill()
        _i, fut = self._flight.popleft()
        return fut.result()

    def take(self, count: int) -> Iterator[tuple[str, LoadedPart | None]]:
        for _ in range(count):
            yield self.next()

    def close(self) -> None:
        """Nothing more is read; reads in flight are waited for, their buffers given back."""
        self._queue.clear()
        while self._flight:
            self._give_back(self._flight.popleft()[1])

    def _give_back(self, fut: Future[tuple[str, LoadedPart | None]]) -> None:
        try:
            _reason, part = fut.result()
        except BaseException:  # noqa: BLE001 - a read that raised holds no buffer
            return
        if part is not None:
            self._worker._return_buffers([part])


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0: unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _exiting() -> bool:
    """The interpreter is exiting: `concurrent.futures` has stopped the service's pools (their
    idle threads; the save threads drain their queue meanwhile), or the main thread has ended."""
    return pools_stopped() or not threading.main_thread().is_alive()


def _ahead_for(service: KVCacheService | None) -> int:
    """Entries of one load job read at once: one per two usable cores, up to `_READ_AHEAD`, or
    one per reader process where there are more of them (they start on a GPU only; each reads
    one part at a time), up to `_READ_AHEAD_HELPERS`."""
    own = max(1, min(_READ_AHEAD, usable_cores() // 2))
    helpers = service.reader_processes if service is not None and torch.cuda.is_available() else 0
    return max(own, min(_READ_AHEAD_HELPERS, helpers))
