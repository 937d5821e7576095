"""What the parts of a worker share: its store, its rank, and vLLM's KV caches once registered."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from galahad.adapters.cuda.transfer import CudaBlockTransfer
from galahad.adapters.vllm.blocks import KVBlocks
from galahad.adapters.vllm.metadata import EntryRef, GalahadWorkerMetadata
from galahad.app.service import KVCacheService
from galahad.app.service import LoadedPart as StoredPart
from galahad.domain.namespace import GroupKind
from galahad.domain.plan import StatePlan
from galahad.format.fanout import pools_stopped

__all__ = ["WorkerContext", "exiting"]


@dataclass(eq=False)
class WorkerContext:
    """`blocks` and `cuda` are set when vLLM registers its KV caches (`GalahadWorker.register`);
    `report` is what the worker tells the scheduler side next (taken, and replaced, by
    `GalahadWorker.take_report` on the engine's thread, where loads and saves fill it too)."""

    service: KVCacheService | None
    rank: int
    block_size: int
    single_group: bool  # one KV cache group (vLLM takes block-level load errors only then)
    perturb: str = ""  # a test hook (GALAHAD_TEST_PERTURB_LOAD): loads copy altered KV in
    plan: StatePlan = field(init=False)
    blocks: KVBlocks | None = None
    cuda: CudaBlockTransfer | None = None
    report: GalahadWorkerMetadata = field(default_factory=GalahadWorkerMetadata)

    def __post_init__(self) -> None:
        self.plan = StatePlan(self.service.namespace.groups) if self.service is not None else StatePlan(())

    def is_state(self, group: int) -> bool:
        return self.plan.groups[group].kind is GroupKind.STATE

    def nrows(self, entry: EntryRef) -> int:
        """The blocks of one group an entry spans."""
        return (entry.end - entry.start) // self.block_size

    def entry_bytes(self, entry: EntryRef) -> int:
        """The payload bytes of this rank's part of `entry` (0 before registration)."""
        if self.blocks is None:
            return 0
        nrows = [len(p.blocks) for p in self.plan.parts(entry.start, entry.end)]
        return sum(nrows[layer.group] * layer.page_bytes for layer in self.blocks.layers())

    def misfit(self, entry: EntryRef, part: StoredPart) -> str:
        """Why a verified part does not fit this engine's blocks ("" when it fits)."""
        if self.blocks is None:
            return "no KV caches registered"
        layers = self.blocks.layers()
        segs = part.header.segments
        if len(segs) != len(layers):
            return f"{len(segs)} segments for {len(layers)} layers"
        nrows = [len(p.blocks) for p in self.plan.parts(entry.start, entry.end)]
        for seg, layer in zip(segs, layers):
            if seg.group != layer.group or seg.nbytes != nrows[layer.group] * layer.page_bytes:
                return f"segment {seg.group}/{seg.layer} holds {seg.nbytes} bytes"
        return ""


def exiting() -> bool:
    """The interpreter is exiting: `concurrent.futures` has stopped the service's pools (their
    idle threads; the save threads drain their queue meanwhile), or the main thread has ended."""
    return pools_stopped() or not threading.main_thread().is_alive()
