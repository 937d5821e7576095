"""Moving blocks between an engine's paged KV tensors and host buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["TensorTransfer"]


class TensorTransfer(Protocol):
    """Gathers a request's blocks from the paged KV cache into host bytes and scatters them back.

    Contract: `scatter(segment, ids, gather(segment, ids))` leaves the cache unchanged;
    `gather` returns exactly `segment_bytes(segment, len(ids))` bytes; `scatter` writes only the
    listed blocks of the listed segment. Segments are the engine's per-layer (or per-group) tensors,
    named as the adapter registered them.
    """

    def segments(self) -> Sequence[str]: ...

    def segment_bytes(self, segment: str, num_blocks: int) -> int: ...

    def gather(self, segment: str, block_ids: Sequence[int]) -> memoryview: ...

    def scatter(self, segment: str, block_ids: Sequence[int], data: memoryview) -> None: ...
