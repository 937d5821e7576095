"""What the scheduler side ships to the workers each step, and what the workers report back.

Plain, picklable values: vLLM sends `GalahadMetadata` to every worker process with the scheduler
output, and aggregates every worker's `GalahadWorkerMetadata` into one before handing it to the
scheduler side (`KVOutputAggregator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = [
    "EntryRef",
    "GalahadHandshake",
    "GalahadMetadata",
    "GalahadWorkerMetadata",
    "LoadJob",
    "SaveJob",
]


@dataclass(frozen=True)
class EntryRef:
    """One stored entry: its chain key, the tokens `[start, end)` it holds, and engine blocks.

    `blocks[g]` lists, for KV cache group g, the engine block ids the entry's payload rows of that
    group map to (save: the source of every row; load: the destination of rows from
    `first_rows[g]` on). Groups store different rows (`StatePlan`): a sliding window only its
    window, a state group one block.
    """

    key: bytes
    start: int
    end: int
    blocks: tuple[tuple[int, ...], ...]
    first_rows: tuple[int, ...] = ()

    def first_row(self, group: int) -> int:
        """The stored row of `group` that goes to `blocks[group][0]` (loads)."""
        return self.first_rows[group] if self.first_rows else 0


@dataclass(frozen=True)
class LoadJob:
    """Load `entries` (in chain order) into a request's blocks. `async_load`: report via finished_recving."""

    req_id: str
    entries: tuple[EntryRef, ...]
    async_load: bool
    tokens: int  # tokens the load covers (for counters)
    broken: bool = False  # the scheduler side could not plan it: report the request as failed


@dataclass(frozen=True)
class SaveJob:
    """Copy a finished prompt's blocks out and write one part per entry."""

    req_id: str
    entries: tuple[EntryRef, ...]


@dataclass
class GalahadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    step_tokens: int = 0  # tokens this step computes, when it loads nothing (workers time it)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class GalahadWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step reports of every worker, merged: which parts are durable, which loads failed.

    `saved[key]` lists `(rank, ok)` acknowledgements; `held[key]` the ranks that copied the
    entry's part out for saving and keep that copy until the part is durable (a load may come
    from it meanwhile: pending loads); `loaded[req_id]` lists `(rank, failed key or
    None)` results; `failed_keys` maps a key that failed to load to the reason. `steps` and
    `timings` feed the load-or-recompute figures (rank 0's step times, each load's duration).
    """

    saved: dict[bytes, list[tuple[int, bool]]] = field(default_factory=dict)
    held: dict[bytes, list[int]] = field(default_factory=dict)
    loaded: dict[str, list[tuple[int, bytes | None]]] = field(default_factory=dict)
    failed_keys: dict[bytes, str] = field(default_factory=dict)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of timed steps
    timings: dict[str, tuple[int, float]] = field(default_factory=dict)  # req_id -> (bytes, seconds)
    off: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot cache

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GalahadWorkerMetadata):
            return self
        for key, acks in other.saved.items():
            self.saved.setdefault(key, []).extend(acks)
        for key, ranks in other.held.items():
            self.held.setdefault(key, []).extend(ranks)
        for req_id, results in other.loaded.items():
            self.loaded.setdefault(req_id, []).extend(results)
        self.failed_keys.update(other.failed_keys)
        self.off.update(other.off)
        self.steps.extend(other.steps)
        for req_id, (nbytes, seconds) in other.timings.items():  # the slowest rank decides
            mine = self.timings.get(req_id)
            self.timings[req_id] = (nbytes, seconds) if mine is None or seconds > mine[1] else mine
        return self

    def __bool__(self) -> bool:
        return bool(self.saved or self.held or self.loaded or self.failed_keys or self.steps or self.timings
                    or self.off)


@dataclass(frozen=True)
class GalahadHandshake(KVConnectorHandshakeMetadata):
    """What a worker says at startup, after registering its KV caches and before the first
    request: vLLM gathers every worker's and hands them to the scheduler side. Sent only by a
    worker that cannot cache (`off`: why), so that no hit is offered it could only fail."""

    rank: int
    off: str
