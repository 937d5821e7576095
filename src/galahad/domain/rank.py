"""Ranks of a model split over several GPUs, and the commit rule: all ranks or nothing."""

from __future__ import annotations

from collections.abc import Collection

import attrs

__all__ = ["RankLayout"]


@attrs.frozen
class RankLayout:
    """Tensor x pipeline layout. Rank r = pp_rank * tp_size + tp_rank.

    `dp_size` data-parallel engines run this layout side by side, each with its own connector
    and its own ranks 0 .. world_size - 1: they share entries, and count only for the licence,
    whose points cover every GPU rank of the deployment (`gpu_ranks`).

    Replicated KV is stored once: `tp_replicas` consecutive TP ranks of a stage that hold the
    same KV bytes (more TP ranks than KV heads: each head is replicated on tp_size / heads ranks)
    share one part, written by the first of them and read by all. `replicated` is the whole-stage
    case (MLA-style caches: every TP rank of a stage holds the same bytes, tp_replicas = tp_size).
    """

    tp_size: int = 1
    pp_size: int = 1
    replicated: bool = False
    tp_replicas: int = 1
    dp_size: int = 1

    def __attrs_post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tp_size and pp_size must be at least 1, got {self.tp_size}, {self.pp_size}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {self.dp_size}")
        if self.tp_replicas < 1 or self.tp_size % self.tp_replicas:
            raise ValueError(f"tp_replicas must divide tp_size {self.tp_size}, got {self.tp_replicas}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def gpu_ranks(self) -> int:
        """Every GPU rank of the deployment, what a licence's points count: tp x pp x dp."""
        return self.world_size * self.dp_size

    @property
    def replicas(self) -> int:
        """How many consecutive TP ranks share one part (1: every rank has its own)."""
        return self.tp_size if self.replicated else self.tp_replicas

    def all_ranks(self) -> range:
        return range(self.world_size)

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def part_of(self, rank: int) -> int:
        """The part (a rank number) that `rank` writes and reads."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return rank - (rank % self.tp_size) % self.replicas

    def writes(self, rank: int) -> bool:
        return self.part_of(rank) == rank

    def parts(self) -> tuple[int, ...]:
        """Every part an entry must have to count as committed."""
        return tuple(sorted({self.part_of(r) for r in self.all_ranks()}))

    def is_complete(self, durable_parts: Collection[int]) -> bool:
        """The commit rule: an entry counts only when every part is durable."""
        return set(self.parts()) <= set(durable_parts)

    def describe(self) -> str:
        """`tp 2 x pp 1` (`x dp 2` with data-parallel engines), with the sharing of replicated
        parts when there is any."""
        text = f"tp {self.tp_size} x pp {self.pp_size}"
        if self.dp_size > 1:
            text += f" x dp {self.dp_size}"
        if self.replicas > 1:
            parts = len(self.parts())
            text += f", KV replicated on {self.replicas} TP ranks: {parts} part{'' if parts == 1 else 's'} per entry"
        return text
