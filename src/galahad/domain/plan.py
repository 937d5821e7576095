"""The hybrid state plan: what each KV cache group contributes to an entry. All groups or none."""

from __future__ import annotations

import attrs

from galahad.domain.namespace import GroupKind, KVGroup

__all__ = ["GroupPart", "GroupRestore", "StatePlan"]


@attrs.frozen
class GroupPart:
    """The block indices (into the request's block table of one group) an entry saves and loads."""

    group: int
    blocks: range


@attrs.frozen
class GroupRestore:
    """Where one group's stored rows go in a load: block indices `blocks`, from stored row `first_row`."""

    group: int
    blocks: range
    first_row: int


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
                first = max(first, last - self.window_blocks(group))
            elif group.kind is GroupKind.STATE:
                first = max(first, last - 1)
            out.append(GroupPart(index, range(first, last)))
        return tuple(out)

    def restore(self, span_start: int, span_end: int, start: int, end: int) -> tuple[GroupRestore, ...]:
        """Per group, what an entry holding `[span_start, span_end)` gives a load of `[start, end)`.

        A request resuming at `end` needs, per group, the blocks `parts(start, end)` names (tokens
        before `start` are the engine's own); of those, the ones this entry stored. In `chunk` order
        a load reads several entries: each fills its share, and blocks an earlier entry stored but
        the request no longer needs (outside the window, a superseded state) are not written.
        """
        out = []
        for stored, needed in zip(self.parts(span_start, span_end), self.parts(start, end)):
            lo = max(stored.blocks.start, needed.blocks.start)
            hi = max(lo, min(stored.blocks.stop, needed.blocks.stop))
            out.append(GroupRestore(stored.group, range(lo, hi), lo - stored.blocks.start))
        return tuple(out)

    @staticmethod
    def window_blocks(group: KVGroup) -> int:
        """Blocks a sliding-window group keeps for the next token: ceil((window - 1) / block)."""
        return -(-(group.window_tokens - 1) // group.block_size)

    def describe(self) -> str:
        """One line per group: its kind, layers, and what an entry saves of it."""
        lines = []
        for index, group in enumerate(self.groups):
            layers = f"{group.num_layers} layer{'s' if group.num_layers != 1 else ''}"
            if group.kind is GroupKind.FULL:
                what = f"full attention, {layers}: every block of the prefix"
            elif group.kind is GroupKind.SLIDING:
                n = self.window_blocks(group)
                what = (f"sliding window of {group.window_tokens} tokens, {layers}: the last {n} "
                        f"block{'s' if n != 1 else ''} ({n * group.block_size} tokens) before "
                        "the saving point")
            else:
                what = f"running state (mamba / linear attention), {layers}: the state block at the saving point"
            lines.append(f"group {index} ({group.block_size}-token blocks): {what}")
        return "; ".join(lines)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or any(g.kind is not GroupKind.FULL for g in self.groups)
