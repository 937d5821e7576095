"""Saving: a step's blocks copied out on the engine's thread, sealed and written on the service's
save threads, each acknowledged to the scheduler side (written or not).

The copy is made in `wait_for_save`, so a block freed or reused afterwards cannot be read
half-written. On CUDA the blocks are gathered on a save stream into a pinned buffer reserved at
registration, the compute stream waiting only for the device-side gather; on the CPU build they
are copied into ordinary memory. Either way the copies waiting to be written are bounded (the
pinned buffers; `backlog_bytes` of ordinary memory): when the disk or the cipher falls behind, a
new save is skipped and counted (`saves_skipped_backlog`), never waited for and never queued
beyond the bound. Nothing is pinned here: a request never pays for page-locking memory.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from galahad.adapters.cuda.pinned import PinnedBuffer
from galahad.adapters.cuda.transfer import CudaBlockTransfer
from galahad.adapters.vllm.blocks import KVBlocks, LayerView
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata
from galahad.adapters.vllm.worker.context import WorkerContext, exiting
from galahad.adapters.vllm.worker.parts import Hold, SaveCopy
from galahad.adapters.vllm.worker.pending import PendingSaves
from galahad.adapters.vllm.worker.readahead import StartupReadAhead
from galahad.app.service import KVCacheService, SegmentSpec
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.counter import SkipReason

__all__ = ["SAVE_BATCH", "Saver", "backlog_bytes", "segment_of"]

log = logging.getLogger(__name__)

SAVE_BATCH = 128 << 20  # a step's saves are gathered out in batches of at most this many bytes
SLOW_SAVE_S = 20.0  # a part written later than this after its step gets one warning
_BACKLOG_LEAST, _BACKLOG_MOST = 256 << 20, 4 << 30  # bounds of `backlog_bytes`


def backlog_bytes(available: int) -> int:
    """The ordinary memory that copies of saves not yet written may hold (the byte path): an
    eighth of the host's available memory `available`, within 256 MiB and 4 GiB (1 GiB when
    unknown). Enough for several steps' saves to ride out a slow write; never enough to starve
    the engine's own memory."""
    if available <= 0:
        return 1 << 30
    return max(_BACKLOG_LEAST, min(_BACKLOG_MOST, available // 8))


class Saver:
    """`delay`: a test hook (GALAHAD_TEST_SAVE_DELAY: seconds, and a file that must exist for it
    to apply); (0, None) in production. `backlog`: the bytes of ordinary memory that copies of
    saves not yet written may hold (`backlog_bytes`)."""

    def __init__(self, ctx: WorkerContext, pending: PendingSaves, read_ahead: StartupReadAhead, *,
                 writes: bool, backlog: int, delay: tuple[float, str | None] = (0.0, None)) -> None:
        self._ctx, self._pending, self._read_ahead = ctx, pending, read_ahead
        self.writes = writes  # this rank writes its part (a rank holding another's copy does not)
        self.backlog = backlog
        self.waiting = 0  # bytes of ordinary-memory copies not yet written (at most `backlog`)
        self.delay = delay
        self.off = False  # `GalahadWorker.cannot_cache`: saves are acknowledged as not written
        self.stopping = False  # the worker is shutting down: saves not started are dropped
        self._lock = threading.Lock()
        self._acks: list[tuple[bytes, bool]] = []
        self._segments: dict[int, list[SegmentSpec]] = {}  # the CUDA path's segment table by block count
        self._warned_backlog = False
        self._warned_slow = False
        self._told_exit = False

    def take_acks(self) -> list[tuple[bytes, bool]]:
        with self._lock:
            acks, self._acks = self._acks, []
        return acks

    def save(self, meta: GalahadMetadata) -> None:
        """Copy every save job's blocks out now; seal and write them on the save threads.

        On CUDA, a step's entries (chunk order: one per 64 tokens) are copied out together, up to
        `SAVE_BATCH` bytes at a time (`gather_many`): the engine thread launches two kernels a
        layer per batch, not a layer's copy per entry.

        Once a save of a request is skipped (the bound of copies waiting to be written), its later
        entries in the step are skipped too: a prompt loads its entries in order up to the first
        one missing, so those could not be loaded before the skipped one is saved again, and the
        disk's time goes to entries that can."""
        if not self.writes:
            return
        entries = [(job.req_id, entry) for job in meta.saves for entry in job.entries]
        if self.off:  # nothing more is written, and nothing is left waiting
            for _req, entry in entries:
                self._ack(entry.key, False)
            return
        gapped: set[str] = set()  # requests with a save skipped in this step
        for batch in self._batches(entries):
            live = [entry for req, entry in batch if req not in gapped]
            for req, entry in batch:
                if req in gapped:
                    self._skip(entry.key, self._ctx.service)
            if not live:
                continue
            try:
                saved = self._save_entry(live[0]) if len(live) == 1 else self._save_together(live)
            except Exception:  # noqa: BLE001 - a failed save is a future miss
                log.warning("[galahad] save of %s failed", live[0].key.hex()[:16], exc_info=True)
                for entry in live:
                    self._pending.unhold(entry.key)
                    self._ack(entry.key, False)
                continue
            if not saved:
                gapped.update(req for req, _entry in batch)

    def _batches(self, entries: list[tuple[str, EntryRef]]) -> list[list[tuple[str, EntryRef]]]:
        """The (request, entry) pairs in consecutive batches of at most `SAVE_BATCH` bytes (one
        each without a CUDA path that gathers many)."""
        cuda = self._ctx.cuda
        if cuda is None or self._ctx.service is None or self._ctx.blocks is None or not cuda.can_gather_many():
            return [[pair] for pair in entries]
        out: list[list[tuple[str, EntryRef]]] = []
        size = 0
        for req, entry in entries:
            n = cuda.payload_bytes(len(entry.blocks[0]))
            if out and size + n <= SAVE_BATCH:
                out[-1].append((req, entry))
                size += n
            else:
                out.append([(req, entry)])
                size = n
        return out

    def _save_together(self, batch: list[EntryRef]) -> bool:
        """Gather a batch of entries into one pinned buffer; each is sealed and written on its own
        save thread, and the buffer goes back to the pool once the last of them is written.
        False: skipped (no free pinned buffer fits)."""
        service, blocks, cuda = self._ctx.service, self._ctx.blocks, self._ctx.cuda
        if service is None or blocks is None or cuda is None:  # _batches made one-entry batches
            raise RuntimeError("no CUDA path to gather a batch of saves")
        sizes = [len(entry.blocks[0]) for entry in batch]
        buf = self._read_ahead.acquire(cuda, cuda.payload_bytes(sum(sizes)), False)
        if buf is None:  # the pool is at its cap: see _save_entry_cuda
            for entry in batch:
                self._skip(entry.key, service)
            return False
        try:
            gathered = cuda.gather_many([entry.blocks for entry in batch], buf)
        except BaseException:
            cuda.pool.release(buf)  # nothing was queued into it
            raise
        copy = SaveCopy(cuda, gathered, len(batch))  # given back once every entry is written
        offset = 0
        writes: list[Callable[[], None]] = []
        for entry, nrows in zip(batch, sizes):
            segments = self._layer_segments(blocks, nrows)
            n = cuda.payload_bytes(nrows)
            self._pending.hold(entry.key, Hold(nrows, n, copy, gathered.host[offset : offset + n]))

            def payload(at: int = offset, n: int = nrows) -> list[memoryview]:
                gathered.wait()
                return gathered.views(cuda.segment_bytes(n), at)

            writes.append(self._write(service, entry, segments, payload,
                                      functools.partial(self._pending.written, entry.key, copy),
                                      self._shared_at(service, buf, offset)))
            offset += n
        try:
            service.submit_saves(writes)  # one hand-over for the batch, not one per entry
        except BaseException:  # not queued (the service is closing): the copies go back now
            for entry in batch:
                self._pending.written(entry.key, copy)
            raise
        return True

    def _save_entry(self, entry: EntryRef) -> bool:
        """Copy one entry out and queue its part; False: skipped (the bound of copies waiting)."""
        ctx = self._ctx
        service, blocks = ctx.service, ctx.blocks
        if service is None or blocks is None:
            self._ack(entry.key, False)
            return True
        if ctx.cuda is not None:
            return self._save_entry_cuda(entry, service, blocks, ctx.cuda)
        size = sum(len(entry.blocks[layer.group]) * layer.page_bytes for layer in blocks.layers())
        with self._lock:
            # over the bound: skipped, unless nothing waits (an entry larger than the bound alone)
            full = self.waiting > 0 and self.waiting + size > self.backlog
            if not full:
                self.waiting += size
        if full:
            self._skip(entry.key, service)
            return False
        segments, rows = [], []
        try:
            index = blocks.indices(entry.blocks)
            for layer in blocks.layers():
                rows.append(blocks.gather(layer, index[layer.group]))
                segments.append(segment_of(layer, len(entry.blocks[layer.group]), ctx.is_state(layer.group)))
        except BaseException:
            self._written(size)
            raise
        views = [r.numpy().reshape(-1).data for r in rows]
        if ctx.single_group:  # several groups store per-group rows: loaded from the disk only
            self._pending.hold(entry.key, Hold(len(entry.blocks[0]), sum(v.nbytes for v in views), views=views))

        def done() -> None:
            self._pending.written(entry.key, None)
            rows.clear()
            self._written(size)

        self._submit(service, entry, segments, lambda: views, done)
        return True

    def _layer_segments(self, blocks: KVBlocks, nrows: int) -> list[SegmentSpec]:
        """The segment table of an entry of `nrows` blocks on the CUDA path (one full-attention
        group: the same for every entry of that many blocks), made once per count: a step saves
        one entry per 64 tokens, and this runs on the engine's thread."""
        segments = self._segments.get(nrows)
        if segments is None:
            segments = self._segments[nrows] = [segment_of(layer, nrows) for layer in blocks.layers()]
        return segments

    def _written(self, size: int) -> None:
        with self._lock:
            self.waiting -= size

    def _save_entry_cuda(self, entry: EntryRef, service: KVCacheService, blocks: KVBlocks,
                         cuda: CudaBlockTransfer) -> bool:
        """Gather on the save stream now; seal and write on the save threads once it reached the
        host. False: skipped (no free pinned buffer fits)."""
        nrows = len(entry.blocks[0])
        segments = self._layer_segments(blocks, nrows)
        buf = self._read_ahead.acquire(cuda, cuda.payload_bytes(nrows), False)
        if buf is None:
            # Every pinned buffer holds a save not yet written: the disk or the cipher is slower
            # than the engine makes KV. Skip this save rather than stall the forward pass on a
            # copy into ordinary memory or on pinning more.
            self._skip(entry.key, service)
            return False
        gathered = cuda.gather(entry.blocks, buf)
        copy = SaveCopy(cuda, gathered, 1)
        self._pending.hold(entry.key, Hold(nrows, gathered.nbytes, copy, gathered.host))

        def payload() -> list[memoryview]:
            gathered.wait()
            return gathered.views(cuda.segment_bytes(nrows))

        self._submit(service, entry, segments, payload, functools.partial(self._pending.written, entry.key, copy),
                     self._shared_at(service, buf, 0))
        return True

    @staticmethod
    def _shared_at(service: KVCacheService, buf: PinnedBuffer, offset: int) -> int | None:
        """Where a payload copied into `buf` from byte `offset` on lies in the writer processes'
        region (the pinned arena), or None (no writers, or a buffer outside it)."""
        if service.writers is None or buf.arena is None:
            return None
        return buf.start + offset

    def _submit(self, service: KVCacheService, entry: EntryRef, segments: list[SegmentSpec],
                payload: Callable[[], Sequence[Any]], done: Callable[[], None], shared_at: int | None = None) -> None:
        """Seal and write one part on the save threads (`_write`)."""
        write = self._write(service, entry, segments, payload, done, shared_at)
        try:
            service.submit_save(write)
        except BaseException:  # not queued (the service is closing): its copy goes back now
            done()
            raise

    def _write(self, service: KVCacheService, entry: EntryRef, segments: list[SegmentSpec],
               payload: Callable[[], Sequence[Any]], done: Callable[[], None],
               shared_at: int | None = None) -> Callable[[], None]:
        """What a save thread runs for one part: seal and write it, acknowledge it, then `done()`
        (frees the copy); `payload()` gives its segments' bytes there, which lie in the writer
        processes' region from byte `shared_at` on where not None (a writer seals them)."""
        key, span = ChainKey(entry.key), Span(entry.start, entry.end)
        rank = self._ctx.rank
        shipped = time.monotonic()

        def write() -> None:
            ok = False
            try:
                if self.stopping or exiting():
                    self._drop_at_exit(service)
                    return
                seconds, gate = self.delay
                if seconds and (gate is None or os.path.exists(gate)):
                    time.sleep(seconds)
                service.yield_to_loads()  # a load running now goes first, a bounded while
                # False also when the part exists already (another request wrote it): durable
                ok = (service.save_part(key, span, rank, segments, payload(), shared_at=shared_at)
                      or service.has_part(key, rank))
            except Exception:  # noqa: BLE001 - thread boundary
                if self.stopping or exiting():  # torn down under it: no longer a fault to report
                    log.debug("[galahad] writing %s stopped by the exit", entry.key.hex()[:16], exc_info=True)
                else:
                    log.warning("[galahad] writing %s failed", entry.key.hex()[:16], exc_info=True)
            finally:
                self._ack(entry.key, ok)
                done()
                self._note_slow(entry.key, time.monotonic() - shipped)

        return write

    def _note_slow(self, key: bytes, seconds: float) -> None:
        """One warning the first time a part took longer than the scheduler side waits before it
        asks the store (its entry is then committed from the disk, or given up)."""
        if seconds > SLOW_SAVE_S and not self._warned_slow:
            self._warned_slow = True
            log.warning("[galahad] worker rank %d: writing the part of %s took %.0f s after its step "
                        "(disk or save threads overloaded); it was acknowledged late", self._ctx.rank,
                        key.hex()[:16], seconds)

    def _drop_at_exit(self, service: KVCacheService) -> None:
        """A save not started when the worker shut down or the process began to exit is not
        written: its entry could only be committed by the scheduler's next steps, and there are
        none. Counted `saves_skipped_exit`; said once."""
        service.count_skipped(SkipReason.EXIT)
        with self._lock:
            first, self._told_exit = not self._told_exit, True
        if first:
            log.info("[galahad] worker rank %d: stopping; saves not yet written are dropped (counted "
                     "saves_skipped_exit; what is already stored is kept)", self._ctx.rank)

    def _skip(self, key: bytes, service: KVCacheService | None) -> None:
        """A save skipped at the bound of copies waiting to be written (counted, said once)."""
        if service is None:  # nothing is counted or written without a store
            self._ack(key, False)
            return
        service.count_skipped(SkipReason.BACKLOG)
        if not self._warned_backlog:
            self._warned_backlog = True
            held = "every pinned buffer" if self._ctx.cuda is not None else f"{self.backlog >> 20} MiB of memory"
            log.warning("[galahad] worker rank %d: saves skipped while the disk catches up (%s holds "
                        "saves not yet written; the engine does not wait for them); counted as "
                        "saves_skipped_backlog", self._ctx.rank, held)
        self._ack(key, False)

    def _ack(self, key: bytes, ok: bool) -> None:
        with self._lock:
            self._acks.append((key, ok))


def segment_of(layer: LayerView, nrows: int, state: bool = False) -> SegmentSpec:
    """The segment of one layer (kind 1 for a state group): its logical block shape, or raw bytes
    when pages are padded."""
    elem = layer.dtype.itemsize
    kind = 1 if state else 0
    if math.prod(layer.block_shape) * elem == layer.page_bytes:
        return SegmentSpec(layer.group, layer.index, kind, layer.dtype_name, (nrows, *layer.block_shape))
    return SegmentSpec(layer.group, layer.index, kind, "uint8", (nrows, layer.page_bytes))
