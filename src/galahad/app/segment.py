"""The tensor slices of a part, as an engine adapter describes them (`SegmentSpec`), and the
header's segment table they make (`header_segments`): what a save writes and a load expects."""

from __future__ import annotations

import functools

import attrs

from galahad.format.v1 import Segment

__all__ = ["SegmentSpec", "header_segments"]


@attrs.frozen(cache_hash=True)  # every saved part looks its segment table up by these
class SegmentSpec:
    """One tensor slice of a part: a group's layer (kind 0: KV blocks, 1: state), dtype and shape."""

    group: int
    layer: int
    kind: int
    dtype: str
    shape: tuple[int, ...]


def header_segments(specs: tuple[SegmentSpec, ...]) -> tuple[Segment, ...]:
    """The header's segment table for these specs (cached: every part of a model has the same)."""
    try:
        return _cached_segments(specs)
    except TypeError:  # a spec with an unhashable field (a list for a shape): built each time
        return _build_segments(specs)


def _build_segments(specs: tuple[SegmentSpec, ...]) -> tuple[Segment, ...]:
    return tuple(Segment(group=s.group, kind=s.kind, dtype=s.dtype, layer=s.layer, shape=tuple(s.shape)) for s in specs)


_cached_segments = functools.lru_cache(maxsize=64)(_build_segments)
