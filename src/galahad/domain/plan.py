"""The hybrid state plan: what each KV cache group contributes to an entry. All groups or none."""

from __future__ import annotations

import attrs

from galahad.domain.namespace import GroupKind, KVGroup

__all__ = ["GroupPart", "StatePlan"]


@attrs.frozen
class GroupPart:
    """The block indices (into the request's block table of one group) an entry saves and loads."""

    group: int
    blocks: range


@attrs.frozen
class StatePlan:
    """Per group, which blocks an entry covering tokens `[start, end)` holds.

    - full attention: every block of the span;
    - sliding window: only the blocks inside the window that ends at `end` (the window a request
      resuming at `end` still attends to), clipped to the span;
    - state (mamba / linear attention): the one block holding the state at `end`.
    """

    groups: tuple[KVGroup, ...]

    def parts(self, start: int, end: int) -> tuple[GroupPart, ...]:
        out = []
        for index, group in enumerate(self.groups):
            bs = group.block_size
            first, last = start // bs, end // bs
            if group.kind is GroupKind.SLIDING:
                needed = -(-(group.window_tokens - 1) // bs)
                first = max(first, last - needed)
            elif group.kind is GroupKind.STATE:
                first = max(first, last - 1)
            out.append(GroupPart(index, range(first, last)))
        return tuple(out)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1
