"""The worker side of the connector, in every TP/PP worker process: it registers vLLM's KV
caches and hands each step's saves to `Saver` and loads to `Loader`; pending saves' copies
(`PendingSaves`) and the startup read-ahead (`StartupReadAhead`) are what loads may take from
memory. Rank 0 also times the forward steps that load nothing: the prefill figures of the
load-or-recompute choice (`advisor.py`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from galahad.adapters.cuda.transfer import CudaBlockTransfer, transfer_for
from galahad.adapters.helpers.pool import HelperPool, SharedRegion
from galahad.adapters.vllm.blocks import KVBlocks, UnsupportedLayout
from galahad.adapters.vllm.metadata import GalahadMetadata, GalahadWorkerMetadata
from galahad.adapters.vllm.worker.context import WorkerContext
from galahad.adapters.vllm.worker.loads import Loader
from galahad.adapters.vllm.worker.pending import PendingSaves
from galahad.adapters.vllm.worker.readahead import StartupReadAhead, available_memory
from galahad.adapters.vllm.worker.saves import SAVE_BATCH, Saver, backlog_bytes
from galahad.app.service import KVCacheService
from galahad.domain.namespace import GroupKind, PayloadOrder
from galahad.domain.rank import RankLayout

__all__ = ["GalahadWorker", "arena_bytes"]

log = logging.getLogger(__name__)

# the pinned arena's usual size, and its largest: the pool's 16 GiB cap keeps room for load buffers
_ARENA_LEAST, _ARENA_MOST = 6 << 30, 12 << 30
_ARENA_BESIDE = 2 << 30  # saves still being written that the longest prompt's save finds room beside
_TIME_EVERY = 4  # on CUDA, one step in this many that could be timed is (`step_started`)


def arena_bytes(kv_bytes: int, longest: int) -> int:
    """The pinned arena a worker reserves at startup: 6 GiB, or room for the save of the longest
    prompt the engine takes (`longest` bytes of KV) beside 2 GiB of saves still being written,
    whichever is more; never more than the KV cache (`kv_bytes`) or 12 GiB. Saves
    are cut from the arena whole: in a 6 GiB arena a 32k-token prompt of an 8B model (4.8 GB) found
    no room while the 2k prompts before it were still being written, and was skipped."""
    return min(kv_bytes, _ARENA_MOST, max(_ARENA_LEAST, longest + _ARENA_BESIDE))


class GalahadWorker:
    """`perturb`, `save_delay`: test hooks (GALAHAD_TEST_PERTURB_LOAD, GALAHAD_TEST_SAVE_DELAY);
    `pending_loads`: loads may copy in what saves not yet durable hold; `preload_bytes`:
    GALAHAD_PRELOAD_BYTES (None: auto); `max_tokens`: vLLM's `max_model_len` (sizes the pinned
    arena, `arena_bytes`)."""

    def __init__(self, service: KVCacheService | None, rank: int, layout: RankLayout,
                 kv_cache_config: Any, block_size: int, *, perturb: str = "",
                 save_delay: tuple[float, str | None] = (0.0, None), pending_loads: bool = False,
                 preload_bytes: int | None = 0, max_tokens: int = 0) -> None:
        self.rank = rank
        self.max_tokens = max_tokens  # the longest prompt the engine takes (0: not said)
        self.part = layout.part_of(rank)
        self.writes = self.part == rank
        self.kv_cache_config = kv_cache_config
        self.ctx = WorkerContext(service, rank, block_size, len(kv_cache_config.kv_cache_groups) == 1, perturb)
        self.pending = PendingSaves(self.ctx, pending_loads and self.writes)
        self.read_ahead = StartupReadAhead(self.ctx, preload_bytes)
        self.saver = Saver(self.ctx, self.pending, self.read_ahead, writes=self.writes,
                           backlog=backlog_bytes(available_memory()), delay=save_delay)
        self.loader = Loader(self.ctx, self.pending, self.read_ahead)
        self._off = ""  # why this worker cannot cache (`cannot_cache`), told the scheduler side once
        self._off_told = False
        self._step: tuple[int, float, Any] | None = None  # tokens, start time, start CUDA event
        self._timed_steps: list[tuple[int, Any, Any]] = []  # CUDA steps waiting for their events
        self._timable = 0  # CUDA steps that could have been timed so far

    @property
    def service(self) -> KVCacheService | None:
        return self.ctx.service

    @property
    def blocks(self) -> KVBlocks | None:
        return self.ctx.blocks

    @property
    def cuda(self) -> CudaBlockTransfer | None:
        return self.ctx.cuda

    # -- registration ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        try:
            blocks = KVBlocks(kv_caches, self.kv_cache_config)
            first = blocks.layers()[0]
        except UnsupportedLayout as exc:
            log.warning("[galahad] (worker rank %d) NOT CACHING: the KV cache layout cannot be copied "
                        "as whole blocks (%s); the scheduler stops offering hits and saving", self.rank, exc)
            self.cannot_cache(f"the KV cache layout cannot be copied as whole blocks ({exc})")
            return
        except Exception as exc:  # noqa: BLE001 - KV caches of a shape not foreseen: serve, uncached
            log.warning("[galahad] (worker rank %d) NOT CACHING: cannot use the KV caches vLLM registered "
                        "(%s: %s); the scheduler stops offering hits and saving", self.rank,
                        type(exc).__name__, exc, exc_info=True)
            self.cannot_cache(f"cannot use the KV caches vLLM registered ({type(exc).__name__}: {exc})")
            return
        ctx.blocks = blocks
        try:
            self._start_cuda(blocks)
        except Exception:  # noqa: BLE001 - no fast path: the byte path serves
            log.warning("[galahad] worker rank %d: no CUDA transfer path", self.rank, exc_info=True)
        cuda = ctx.cuda
        pinned = "" if cuda is None else (
            f"; CUDA path, {cuda.pool.total_bytes >> 20} MiB of host memory pinned "
            f"(at most {cuda.pool.max_bytes >> 30} GiB)")
        log.info("[galahad] worker rank %d: %d layers, %d blocks of %d bytes per layer%s%s",
                 self.rank, len(blocks.layers()), blocks.num_blocks, first.page_bytes, pinned,
                 "" if self.writes else f" (holds the same KV as rank {self.part}: reads its part)")
        try:
            self.read_ahead.start()
        except Exception:  # noqa: BLE001 - nothing read ahead: loads read the disk as always
            log.warning("[galahad] worker rank %d: reading ahead at startup (GALAHAD_PRELOAD_BYTES) cannot "
                        "start; loads read the disk", self.rank, exc_info=True)

    def _start_cuda(self, blocks: KVBlocks) -> None:
        """The CUDA transfer path, its pinned buffers reserved now rather than on the first
        requests. It moves the same rows for every layer: one full-attention group only (a
        sliding window or a state group stores other rows; the byte path serves them)."""
        ctx = self.ctx
        per_block = sum(layer.page_bytes for layer in blocks.layers())
        longest = min(blocks.num_blocks, -(-self.max_tokens // ctx.block_size)) * per_block
        full_only = all(g.kind is GroupKind.FULL for g in ctx.plan.groups)
        cuda = ctx.cuda = transfer_for(blocks.layers(), single_group=ctx.single_group and full_only,
                                       reserve_bytes=arena_bytes(blocks.num_blocks * per_block, longest))
        if cuda is None:
            return
        self.read_ahead.arena_bytes = cuda.pool.total_bytes
        service = ctx.service
        writers = service is not None and self.writes and self._start_writers(service)
        # chunk order: a load job reads several entries at once and saves come an entry at a time
        if service is not None and service.chunking.order is PayloadOrder.CHUNK:
            entry = cuda.payload_bytes(service.chunking.step // ctx.block_size)
            count = 2 * self.loader.ahead + self.loader.batch
            if not self._start_readers(service, entry, count):
                cuda.pool.reserve(*[entry] * count)
            if self.writes and not writers and cuda.can_gather_many():
                cuda.pool.reserve(SAVE_BATCH, SAVE_BATCH)

    def _start_writers(self, service: KVCacheService) -> bool:
        """Writer processes (`bootstrap.writer_processes_for`) sealing and writing saves from the
        pinned arena, a shared region they map (`PinnedPool.reserve_arena`): every save's copy is
        then cut from the arena. False: none (saves seal in this process, batches of saves from
        two buffers of their own)."""
        cuda = self.ctx.cuda
        region = None if cuda is None else cuda.pool.arena_region
        if region is None or not service.writer_processes:
            return False
        writers = self._helpers(service, region, service.writer_processes, "write")
        if writers is None:
            return False
        service.attach_writers(writers)
        log.info("[galahad] worker rank %d: %d writer processes seal and write saves from a %d MiB "
                 "shared pinned arena", self.rank, service.writer_processes, region.size >> 20)
        return True

    def _start_readers(self, service: KVCacheService, entry: int, count: int) -> bool:
        """Reader processes (`bootstrap.reader_processes_for`) reading loads into a shared pinned
        region that holds the `count` load buffers of `entry` bytes. False: no region (reserve
        plain buffers). Helpers that do not start leave the region as plain buffers."""
        cuda = self.ctx.cuda
        if cuda is None or not service.reader_processes or service.helper_recipe is None:
            return False
        region = cuda.pool.reserve_shared(entry, count)
        if region is None:
            return False
        readers = self._helpers(service, region, service.reader_processes, "read")
        if readers is None:
            return True
        service.attach_readers(readers)
        log.info("[galahad] worker rank %d: %d reader processes read loads "
                 "into a %d MiB shared pinned region", self.rank, service.reader_processes, region.size >> 20)
        return True

    def _helpers(self, service: KVCacheService, region: SharedRegion, processes: int, work: str) -> HelperPool | None:
        """`processes` helpers over `region` (`HelperPool`), or None when they did not start
        (logged: this process then does their work, as without them)."""
        if service.helper_recipe is None:
            return None
        try:
            return HelperPool(region, service.helper_recipe, processes, work=work)
        except Exception:  # noqa: BLE001 - no helpers: this process does their work
            what = "loads are read" if work == "read" else "saves are sealed and written"
            log.warning("[galahad] worker rank %d: %s processes did not start; %s in this process", self.rank,
                        "reader" if work == "read" else "writer", what, exc_info=True)
            return None

    def cannot_cache(self, reason: str) -> None:
        """This worker can neither load nor save (its store did not open, its KV cache layout
        cannot be copied, or its licence was refused while serving): its handshake and its next
        report say so (`connector.py`), and the scheduler side, which may cache, stops offering
        hits this rank could only fail and shipping saves it could only drop. From now on its
        saves are dropped (acknowledged as not written); loads already shipped still run."""
        self._off = reason
        self.saver.off = True

    @property
    def off(self) -> str:
        """Why this worker cannot cache ("" when it can)."""
        return self._off

    # -- the step's hooks -----------------------------------------------------------------------

    def start_load(self, meta: GalahadMetadata) -> None:
        self.loader.start(meta)

    def save(self, meta: GalahadMetadata) -> None:
        self.saver.save(meta)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        return self.loader.results()

    def take_invalid_blocks(self) -> set[int]:
        return self.loader.take_invalid_blocks()

    def stop_saving(self) -> None:
        """At shutdown: saves queued and not yet started are dropped; one being written finishes.
        Parts read ahead at startup and not asked for go back."""
        self.saver.stopping = self.read_ahead.stopping = True
        self.read_ahead.expire()

    def wait_idle(self, timeout: float = 30.0) -> None:
        self.loader.wait_idle(timeout)

    # -- step timing (the engine's prefill figures for load-or-recompute) ----------------------

    def step_started(self, meta: GalahadMetadata) -> None:
        """Time this forward step if it computes tokens and loads nothing (rank 0 reports). On
        CUDA one such step in `_TIME_EVERY` is timed: each takes two timing events recorded and
        read on the engine's thread, and the running figures need no more."""
        self._step = None
        if self.rank != 0 or meta.step_tokens <= 0 or meta.loads or self.ctx.blocks is None:
            return
        event = None
        if self.ctx.cuda is not None:
            self._timable += 1
            if (self._timable - 1) % _TIME_EVERY:  # the first such step is timed, then every fourth
                return
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._step = (meta.step_tokens, time.perf_counter(), event)

    def step_ended(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        tokens, t0, start = step
        if start is None:
            self.ctx.report.steps.append((tokens, time.perf_counter() - t0))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timed_steps.append((tokens, start, end))

    def _resolve_steps(self) -> None:
        waiting = []
        for tokens, start, end in self._timed_steps:
            if end.query():
                self.ctx.report.steps.append((tokens, start.elapsed_time(end) / 1e3))
            else:
                waiting.append((tokens, start, end))
        self._timed_steps = waiting[-16:]

    # -- reporting ------------------------------------------------------------------------------

    def take_report(self) -> GalahadWorkerMetadata | None:
        acks = self.saver.take_acks()
        if self._timed_steps:
            self._resolve_steps()
        report, self.ctx.report = self.ctx.report, GalahadWorkerMetadata()
        for key, ok in acks:
            report.saved.setdefault(key, []).append((self.rank, ok))
        if self._off and not self._off_told:
            self._off_told = True
            report.off[self.rank] = self._off
        return report if report else None
