"""Looking a prompt up: the longest committed prefix (`longest_hit`), and whether a server split
differently saved it (`in_other_layouts`). Pure: no counting, safe to call repeatedly."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from galahad.domain.chain import ChainKey, ChainSeed, chain_keys
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import PayloadOrder

__all__ = ["Hit", "OtherLayout", "in_other_layouts", "longest_hit"]


@attrs.frozen
class Hit:
    """The longest committed prefix found for a request: `end` tokens, in `entries` to load in order.

    `shared` is True for `chunk` order, where the prefix is assembled from 64-token entries that
    any prompt with the same beginning may have written (a chain hit).
    """

    end: int
    entries: tuple[tuple[Span, ChainKey], ...]
    shared: bool


@attrs.frozen
class OtherLayout:
    """The same model saved in the same store by a server split differently (other TP x PP sizes).

    Its entries are never read here (their keys, bytes and rank parts belong to its namespace);
    `committed(key)` only answers whether it holds an entry, so that a miss here can be counted
    as a namespace miss.
    """

    digest: bytes
    tp_size: int
    pp_size: int
    committed: Callable[[ChainKey], bool]

    def describe(self) -> str:
        return f"tp {self.tp_size} x pp {self.pp_size} (namespace {self.digest.hex()[:16]})"


def longest_hit(
    ch: Chunking, ends: Sequence[int], keys: Sequence[ChainKey], already: int, after: Hit | None,
    committed: Callable[[ChainKey], bool], first: Callable[[Sequence[ChainKey]], int | None] | None = None,
) -> Hit | None:
    """The longest prefix of a prompt (its chain `keys`, its probe ends `ends`, longest first,
    as `Chunking.probe_ends` gives them) that `committed` holds, longer than `already` tokens;
    only the entries beyond `after` (a hit an earlier lookup found, taken as still committed)
    are asked about. `first(keys)`: the index of the first of `keys` that `committed` holds (None:
    none), asked of every candidate at once in layer order, where a miss asks at every end."""
    if not ends or ends[0] <= already:
        return None
    known = after.end if after is not None else 0
    if ch.order is PayloadOrder.LAYER:
        floor, step = max(already, known), ch.step
        asked = [end for end in ends if end > floor]
        candidates = [keys[end // step - 1] for end in asked]  # ch.key_index(end)
        found = first(candidates) if first is not None else next(
            (i for i, key in enumerate(candidates) if committed(key)), None)
        if found is not None:
            return Hit(asked[found], ((ch.span_ending_at(asked[found]), candidates[found]),), shared=False)
        return after if after is not None and after.end > already else None
    entries: list[tuple[Span, ChainKey]] = list(after.entries) if after is not None else []
    for end in reversed(ends):  # ascending: a chunk chain is usable up to its first gap
        if end <= known:
            continue
        key = keys[ch.key_index(end)]
        if not committed(key):
            break
        entries.append((ch.span_ending_at(end), key))
    if not entries or entries[-1][0].end <= already:
        return None
    return Hit(entries[-1][0].end, tuple(entries), shared=True)


def in_other_layouts(others: Sequence[OtherLayout], chunking: Chunking, tokens: Sequence[int], seed: ChainSeed,
                     already: int) -> bool:
    """Whether one of `others` holds a committed entry for a prefix of `tokens` longer than
    `already`: its keys are derived (from `seed`, in its namespace) and its markers looked at.
    Raises what its `committed` raises."""
    ends = [end for end in chunking.probe_ends(len(tokens)) if end > already]
    for other in others:
        keys = chain_keys(attrs.evolve(seed, namespace_digest=other.digest), tokens, chunking.step)
        if any(other.committed(keys[chunking.key_index(end)]) for end in ends):
            return True
    return False
