"""Ranks of a model split over several GPUs, and the commit rule: all ranks or nothing."""

from __future__ import annotations

from collections.abc import Collection

import attrs

__all__ = ["RankLayout"]


@attrs.frozen
class RankLayout:
    """Tensor x pipeline layout. Rank r = pp_rank * tp_size + tp_rank.

    With `replicated` (MLA-style caches, or more TP ranks than KV heads) every TP rank of a
    pipeline stage holds the same bytes: only TP rank 0 of each stage writes a part, every rank
    of the stage reads it.
    """

    tp_size: int = 1
    pp_size: int = 1
    replicated: bool = False

    def __attrs_post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tp_size and pp_size must be at least 1, got {self.tp_size}, {self.pp_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def all_ranks(self) -> range:
        return range(self.world_size)

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def part_of(self, rank: int) -> int:
        """The part (a rank number) that `rank` writes and reads."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        if self.replicated:
            return rank - rank % self.tp_size
        return rank

    def writes(self, rank: int) -> bool:
        return self.part_of(rank) == rank

    def parts(self) -> tuple[int, ...]:
        """Every part an entry must have to count as committed."""
        return tuple(sorted({self.part_of(r) for r in self.all_ranks()}))

    def is_complete(self, durable_parts: Collection[int]) -> bool:
        """The commit rule: an entry counts only when every part is durable."""
        return set(self.parts()) <= set(durable_parts)
