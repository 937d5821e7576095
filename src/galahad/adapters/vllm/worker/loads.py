"""Loading: only verified bytes are copied into vLLM's KV cache.

A sync job's entries are copied in as each verified prefix of the job grows (on CUDA read
straight into pinned buffers, then one scatter per batch of entries; a job of one entry layer by
layer as its frames verify); an asynchronous job's entries on the engine's thread once its read
finished (read on the service's I/O pool). A job that fails leaves vLLM exactly the blocks to
recompute, and every load job is reported finished exactly once, failed or not.

Where a part is read from is decided in one place (`Loader.read_one`): the copy a pending save
holds, then what was read ahead at startup, then the store.
"""

from __future__ import annotations

import collections
import enum
import logging
import random
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from galahad.adapters.cuda.transfer import Piece
from galahad.adapters.vllm.blocks import KVBlocks
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, LoadJob
from galahad.adapters.vllm.worker.context import WorkerContext
from galahad.adapters.vllm.worker.parts import Failure, HeldBuffer, LoadOutcome, ReadPart, Source
from galahad.adapters.vllm.worker.pending import PendingSaves
from galahad.adapters.vllm.worker.readahead import StartupReadAhead
from galahad.app.service import KVCacheService
from galahad.domain.chain import ChainKey
from galahad.domain.counter import MissReason
from galahad.format.fanout import usable_cores

__all__ = ["Loader", "ahead_for"]

log = logging.getLogger(__name__)

READ_AHEAD = 8  # at most this many entries of one load job read at once (chunk order: an entry
# per 64 tokens), and at most one per two usable cores, each entry's frames in its own thread
# (on a 16-core GPU host 8 threads read 13.8 GB/s, 16 threads 12.3);
# with reader processes, one entry per process, up to READ_AHEAD_HELPERS
READ_AHEAD_HELPERS = 16


class Mode(enum.Enum):
    """How one entry is read from the store."""

    ALONE = "alone"  # its frames fanned out on the service's frame pool
    STREAMED = "streamed"  # alone, and copied into its blocks layer by layer as its frames verify
    BESIDE = "beside"  # one of several entries read side by side: its frames in the calling thread


class Loader:
    def __init__(self, ctx: WorkerContext, pending: PendingSaves, read_ahead: StartupReadAhead) -> None:
        self._ctx, self._pending, self._read_ahead = ctx, pending, read_ahead
        self._jobs: dict[str, tuple[LoadJob, Future[LoadOutcome]]] = {}  # async jobs not reported yet
        self._invalid: set[int] = set()  # blocks vLLM must recompute
        # Entries of one job read side by side (each on the service's frame pool): a pool of its
        # own, since async jobs already run on the service's I/O pool and wait for these.
        self.ahead = ahead_for(ctx.service)
        self.entry_pool = (ThreadPoolExecutor(self.ahead, thread_name_prefix="galahad-entry")
                           if ctx.service is not None and self.ahead > 1 else None)
        self.batch = 2 * self.ahead  # CUDA: a sync job's verified entries copied in this many at a time

    # -- the step's jobs ------------------------------------------------------------------------

    def start(self, meta: GalahadMetadata) -> None:
        """Sync jobs load now; async jobs are queued and always reported (failed or not) later.

        A sync job with one KV cache group copies each entry in as soon as it and every entry
        before it verified, while the next ones are still read (a failure later in the job still
        leaves a valid prefix: vLLM recomputes only the blocks after it). Whatever goes wrong here,
        every job is still reported, failed if it did not finish: vLLM never computes on blocks
        a load was meant to fill and did not."""
        try:
            self._read_ahead.expire(time.monotonic())
            for job in meta.loads:
                if job.async_load:
                    self._jobs[job.req_id] = (job, self.submit(job))
                elif self._ctx.single_group:
                    placer = _Placer(self, self.batch if self._ctx.cuda is not None else 1)
                    outcome = self.read(job, placer)
                    self.finish(job, outcome, placed=placer.placed)
                else:
                    self.finish(job, self.read(job))
        except Exception:  # noqa: BLE001 - a bug or a broken runtime: recompute, never stale KV
            log.warning("[galahad] starting this step's loads failed; they are recomputed", exc_info=True)
            self._fail_unreported(meta)

    def _fail_unreported(self, meta: GalahadMetadata) -> None:
        """Report every load job of `meta` not reported (sync) or queued (async) yet as failed
        from its first entry: all its blocks are recomputed."""
        report = self._ctx.report
        for job in meta.loads:
            first = job.entries[0] if job.entries else None
            if job.async_load:
                if job.req_id not in self._jobs:
                    done: Future[LoadOutcome] = Future()
                    done.set_result(LoadOutcome([], first, Failure.ERROR))
                    self._jobs[job.req_id] = (job, done)
                continue
            if job.req_id in report.loaded:
                continue
            try:
                self.finish(job, LoadOutcome([], first, Failure.ERROR))
            except Exception:  # noqa: BLE001 - at least vLLM recomputes every block of the job
                for entry in job.entries:
                    self._invalid.update(entry.blocks[0])
                report.loaded.setdefault(job.req_id, []).append((self._ctx.rank, first.key if first else b"broken"))

    def submit(self, job: LoadJob) -> Future[LoadOutcome]:
        """Read an async job on the service's I/O pool."""
        service = self._ctx.service
        try:
            if service is not None:
                return service.submit(self.read, job)
        except Exception:  # noqa: BLE001 - e.g. the pool is shut down: the job fails, reported
            log.warning("[galahad] cannot queue the load of %s", job.req_id, exc_info=True)
        done: Future[LoadOutcome] = Future()
        done.set_result(LoadOutcome([], job.entries[0] if job.entries else None, Failure.DISABLED)
                        if service is not None else self.read(job))
        return done

    # -- reading a job --------------------------------------------------------------------------

    def read(self, job: LoadJob, placer: _Placer | None = None) -> LoadOutcome:
        """Read and verify every entry of `job` in order; stop at the first failure.

        Several entries (chunk order) are read up to `self.ahead` at a time, each entry's frames
        in its own thread. `placer`, when given, takes each part in order as soon as it verified
        and copies them in a batch at a time; a part it took is not in the outcome's `parts`, and
        a batch it could not copy in fails the job at that batch's first entry."""
        if job.broken or not job.entries:
            return LoadOutcome([], None, Failure.BROKEN)
        service = self._ctx.service
        if service is None:
            return self._read_job(job, placer)
        with service.loading():  # saves starting meanwhile wait for it (`galahad.app.priority`)
            return self._read_job(job, placer)

    def _read_job(self, job: LoadJob, placer: _Placer | None) -> LoadOutcome:
        parts: list[ReadPart] = []
        t0 = time.perf_counter()
        service = self._ctx.service
        # GALAHAD_FAULT_LOAD_RATE (test only) fails that share of load jobs, at one of its entries
        fail_at = random.randrange(len(job.entries)) if service is not None and service.draw_fault() else -1
        # one entry read inside the step (layer order): copied in layer by layer as it verifies
        stream = placer is not None and len(job.entries) == 1 and self._ctx.cuda is not None
        results = self.reads(job.entries, fail_at, stream)
        try:
            failed, reason = self._take(job, results, parts, placer)
        finally:
            results.close()  # reads started beyond a failure: waited for, buffers given back
        if placer is not None:  # the verified prefix still waiting for its batch goes in now
            unplaced = placer.flush()
            if unplaced is not None:
                failed, reason = unplaced, Failure.ERROR
        if failed is not None:
            return LoadOutcome(parts, failed, reason)
        return LoadOutcome(parts, seconds=time.perf_counter() - t0)

    @staticmethod
    def _take(job: LoadJob, results: Iterator[ReadPart | Failure], parts: list[ReadPart],
              placer: _Placer | None) -> tuple[EntryRef | None, Failure | None]:
        """Each entry's read result in order, into `placer` (or `parts`), up to the first failure:
        (the entry the job fails at, why), or (None, None)."""
        for entry, got in zip(job.entries, results):
            if isinstance(got, Failure):
                return entry, got
            if placer is None:
                parts.append(got)
                continue
            unplaced = placer.add(entry, got)
            if unplaced is not None:  # the copy failed: nothing from there on is valid
                return unplaced, Failure.ERROR
        return None, None

    def reads(self, entries: tuple[EntryRef, ...], fail_at: int = -1,
              stream: bool = False) -> Generator[ReadPart | Failure, None, None]:
        """`read_one` of each entry in order; with several, `self.ahead` read at once and as many
        more queued behind them, so the threads go on reading while the caller copies a batch in
        (the pinned buffers reserved at registration cover both and a batch)."""
        if len(entries) == 1 or self.entry_pool is None:
            mode = Mode.STREAMED if stream else Mode.ALONE
            for i, entry in enumerate(entries):
                yield self.read_one(entry, fault=i == fail_at, mode=mode)
            return
        reads = _EntryStream(self, list(entries), {fail_at} if fail_at >= 0 else set())
        try:
            yield from reads.take(len(entries))
        finally:
            reads.close()  # not taken (an earlier entry failed): never used, buffers given back

    # -- reading an entry -----------------------------------------------------------------------

    def read_one(self, entry: EntryRef, *, fault: bool = False, mode: Mode = Mode.ALONE) -> ReadPart | Failure:
        """The entry's verified part, or why it cannot be used. From memory where a copy of it is
        kept (a pending save's, then the startup read-ahead's), else from the store. `fault`
        (test only): fail it as an injected fault, read from the store."""
        ctx = self._ctx
        try:
            if ctx.service is None or ctx.blocks is None:
                return Failure.DISABLED
            if not fault and not ctx.perturb:  # memory holds unaltered KV: a perturbing test reads the store
                kept = self._pending.take(entry) or self._read_ahead.take(entry)
                if kept is not None:
                    return kept
            return self._from_store(entry, ctx.service, ctx.blocks, fault, mode)
        except Exception:  # noqa: BLE001 - thread boundary: a failed read is a miss
            log.warning("[galahad] reading %s failed", entry.key.hex()[:16], exc_info=True)
            if ctx.service is not None:
                ctx.service.count_refused(MissReason.ERROR)
            return Failure.ERROR

    def _from_store(self, entry: EntryRef, service: KVCacheService, blocks: KVBlocks, fault: bool,
                    mode: Mode) -> ReadPart | Failure:
        """Read and verify one entry from the store. On the CUDA path straight into a reused pinned
        buffer; `Mode.STREAMED` also copies it into its blocks layer by layer as its frames verify
        (`CudaBlockTransfer.stream_in`), overlapping the read with the host-to-device copies."""
        ctx = self._ctx
        key, cuda, pinned, streamer, nbytes = ChainKey(entry.key), ctx.cuda, None, None, 0
        if cuda is not None and not ctx.perturb:
            nrows = ctx.nrows(entry)
            nbytes = cuda.payload_bytes(nrows)
            pinned = self._read_ahead.acquire(cuda, nbytes, True)
            if pinned is not None and mode is Mode.STREAMED:
                streamer = cuda.stream_in(entry.blocks, pinned.view(nbytes), nrows, entry.first_row(0))
        fan_out = mode is not Mode.BESIDE
        try:
            if cuda is not None and pinned is not None:
                part = service.load_part(key, ctx.rank, out=pinned.memoryview(nbytes), fail=fault, fan_out=fan_out,
                                         progress=streamer.advance if streamer is not None else None,
                                         region_offset=pinned.region_offset if streamer is None else None)
            else:  # a part larger than the entry's blocks is refused before its claim is read
                part = service.load_part(key, ctx.rank, fail=fault, fan_out=fan_out, max_bytes=ctx.entry_bytes(entry))
        except BaseException:
            if cuda is not None and pinned is not None:  # copies made so far: waited for, as below
                cuda.pool.release(pinned, streamer.abandon() if streamer is not None else None)
            raise
        problem = "" if part is None else ctx.misfit(entry, part)
        streamed = False
        if streamer is not None and pinned is not None:
            # copies already made wait for the forward pass, whatever the outcome: a failed load
            # is recomputed into these blocks after them, never overwritten by them
            ready = streamer.abandon() if part is None or problem else streamer.finish()
            pinned.ready = ready if ready is not None else pinned.ready
            streamed = part is not None and not problem
        if part is None:
            if cuda is not None and pinned is not None:
                cuda.pool.release(pinned)
            return Failure.REFUSED
        read = ReadPart(part, Source.STORE, pinned, streamed)
        if problem:
            self.give_back([read])
            log.warning("[galahad] entry %s does not fit this engine (%s); quarantined", entry.key.hex()[:16], problem)
            service.quarantine(key, "shape")
            return Failure.SHAPE
        return read

    # -- copying in -----------------------------------------------------------------------------

    def finish(self, job: LoadJob, outcome: LoadOutcome, *, placed: Sequence[ReadPart] = ()) -> bool:
        """Copy the verified prefix in (after the parts a placer already copied in); record failures.

        Returns True when the request must be reported failed as a whole (`failed_recving`):
        several KV cache groups (vLLM refuses block-level errors then) or a job without blocks.
        """
        ctx = self._ctx
        report = ctx.report
        if job.broken or not job.entries:
            report.loaded.setdefault(job.req_id, []).append((ctx.rank, b"broken"))
            return True
        good = len(placed) + len(outcome.parts)
        if outcome.failed is not None and not ctx.single_group:
            good = 0  # several groups: the request is recomputed whole, nothing is copied in
        t0 = time.perf_counter()
        nbytes = sum(read.nbytes for read in (*placed, *outcome.parts))
        try:
            self.scatter(list(zip(job.entries[len(placed) : good], outcome.parts)))
        except Exception:  # noqa: BLE001 - treat as a failure of the whole job
            log.warning("[galahad] copying a load into the KV cache failed", exc_info=True)
            good, outcome.reason = 0, Failure.ERROR
            outcome.failed = job.entries[0]
        finally:
            self.give_back(outcome.parts)
        failed = outcome.failed
        from_memory = any(read.source is not Source.STORE for read in (*placed, *outcome.parts))
        if failed is None and nbytes and not from_memory:  # a load from memory says nothing of the store's rate
            report.timings[job.req_id] = (nbytes, outcome.seconds + time.perf_counter() - t0)
        if failed is not None:
            for entry in job.entries[good:]:
                self._invalid.update(entry.blocks[0])
            report.failed_keys[failed.key] = (outcome.reason or Failure.ERROR).value
        report.loaded.setdefault(job.req_id, []).append((ctx.rank, None if failed is None else failed.key))
        return failed is not None and not ctx.single_group

    def give_back(self, parts: Sequence[ReadPart]) -> None:
        """The parts' pinned buffers go back (each once): a pool buffer keeps the event of the
        copy still reading it; a save's copy goes back once its save is written too."""
        cuda = self._ctx.cuda
        for read in parts:
            buf, read.buffer = read.buffer, None
            if isinstance(buf, HeldBuffer):
                buf.copy.done_reading(buf.ready)
            elif buf is not None and cuda is not None:
                cuda.pool.release(buf)

    def scatter(self, items: Sequence[tuple[EntryRef, ReadPart]]) -> None:
        """Copy verified parts into their blocks. CUDA: those read into pinned buffers all at once
        on the load stream (`scatter_many`: a few kernels a layer for the whole batch, not a
        layer's copy per entry), the compute stream made to wait for it; each buffer is reused
        only after that copy completed. The rest one at a time, layer by layer."""
        cuda, batch, buffers = self._ctx.cuda, [], []
        for entry, read in items:
            if read.streamed:  # copied in while it was read
                continue
            buf = read.buffer
            if cuda is None or buf is None:
                self._scatter_bytes(entry, read)
                continue
            batch.append(Piece(entry.blocks, buf.view(read.nbytes), self._ctx.nrows(entry), entry.first_row(0)))
            buffers.append(buf)
        if cuda is not None and batch:
            done = cuda.scatter_many(batch)
            for buf in buffers:
                buf.ready = done

    def _scatter_bytes(self, entry: EntryRef, read: ReadPart) -> None:
        """Copy a verified part into its blocks by layer (the byte path: no pinned buffer)."""
        ctx = self._ctx
        blocks = ctx.blocks
        if blocks is None:
            raise RuntimeError("no KV caches registered")
        index = blocks.indices(entry.blocks)
        for layer, view in zip(blocks.layers(), read.segment_views()):
            rows = torch.frombuffer(view, dtype=torch.uint8).view(-1, layer.page_bytes)
            ids = entry.blocks[layer.group]
            if not ids:
                continue  # this entry holds nothing this load needs of the group
            first = entry.first_row(layer.group)
            rows = rows[first : first + len(ids)]
            if ctx.perturb in ("all", ctx.plan.groups[layer.group].kind.value):
                rows = KVBlocks.perturb(layer, rows)
            blocks.scatter(layer, index[layer.group], rows)

    # -- reporting ------------------------------------------------------------------------------

    def results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) for async jobs whose read completed."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, (job, fut) in list(self._jobs.items()):
            if not fut.done():
                continue
            try:
                outcome = fut.result()
            except BaseException:  # noqa: BLE001 - a cancelled or crashed read is a failed load
                outcome = LoadOutcome([], job.entries[0], Failure.ERROR)
            del self._jobs[req_id]
            try:
                if self.finish(job, outcome):
                    failed.add(req_id)
            except Exception:  # noqa: BLE001 - a request nobody reports would wait for ever
                log.warning("[galahad] finishing request %s's load failed; it is recomputed whole", req_id,
                            exc_info=True)
                failed.add(req_id)
            finished.add(req_id)
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        if not self._ctx.single_group:  # vLLM refuses block-level errors for several groups
            self._invalid.clear()
            return set()
        out, self._invalid = self._invalid, set()
        return out

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Let queued reads finish (used at shutdown)."""
        for _job, fut in list(self._jobs.values()):
            try:
                fut.result(timeout=timeout)
            except BaseException:  # noqa: BLE001
                pass


class _Placer:
    """A sync job's verified parts, copied into the KV cache `batch` at a time, in order."""

    def __init__(self, loader: Loader, batch: int) -> None:
        self._loader = loader
        self._batch = max(1, batch)
        self._waiting: list[tuple[EntryRef, ReadPart]] = []
        self.placed: list[ReadPart] = []

    def add(self, entry: EntryRef, read: ReadPart) -> EntryRef | None:
        """Take the next part; copies the batch in once full. Returns the entry the job fails
        at when that copy failed (None: all well)."""
        self._waiting.append((entry, read))
        return self.flush() if len(self._waiting) >= self._batch else None

    def flush(self) -> EntryRef | None:
        """Copy the parts taken so far in; their pinned buffers go back (reused once the copy is
        done). Returns the batch's first entry when the copy failed: none of it counts as placed."""
        batch, self._waiting = self._waiting, []
        if not batch:
            return None
        try:
            self._loader.scatter(batch)
        except Exception:  # noqa: BLE001 - the copy failed: nothing from this batch on is valid
            log.warning("[galahad] copying a load into the KV cache failed", exc_info=True)
            return batch[0][0]
        finally:
            self._loader.give_back([read for _entry, read in batch])
        self.placed.extend(read for _entry, read in batch)
        return None


class _EntryStream:
    """A load job's entries read in order (`Loader.reads`), `2 * loader.ahead` in flight at a
    time on the loader's entry threads; `faults`: indices read as failed (test only)."""

    def __init__(self, loader: Loader, entries: list[EntryRef], faults: set[int]) -> None:
        if loader.entry_pool is None:
            raise RuntimeError("a stream of entries needs the loader's entry threads")
        self._loader, self._pool = loader, loader.entry_pool
        self._queue = collections.deque(enumerate(entries))
        self._faults = faults
        self._flight: collections.deque[Future[ReadPart | Failure]] = collections.deque()

    def _fill(self) -> None:
        while self._queue and len(self._flight) < 2 * self._loader.ahead:
            i, entry = self._queue.popleft()  # side by side: each entry's frames in its own thread
            self._flight.append(self._pool.submit(self._loader.read_one, entry, fault=i in self._faults,
                                                  mode=Mode.BESIDE))

    def take(self, count: int) -> Iterator[ReadPart | Failure]:
        for _ in range(count):
            self._fill()
            yield self._flight.popleft().result()

    def close(self) -> None:
        """Nothing more is read; reads in flight are waited for, their buffers given back."""
        self._queue.clear()
        while self._flight:
            try:
                got = self._flight.popleft().result()
            except BaseException:  # noqa: BLE001 - a read that raised holds no buffer
                continue
            if isinstance(got, ReadPart):
                self._loader.give_back([got])


def ahead_for(service: KVCacheService | None) -> int:
    """Entries of one load job read at once: one per two usable cores, up to `READ_AHEAD`, or
    one per reader process where there are more of them (they start on a GPU only; each reads
    one part at a time), up to `READ_AHEAD_HELPERS`."""
    own = max(1, min(READ_AHEAD, usable_cores() // 2))
    helpers = service.reader_processes if service is not None and torch.cuda.is_available() else 0
    return max(own, min(READ_AHEAD_HELPERS, helpers))
