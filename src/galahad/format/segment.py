"""The segments of a v1 block file: one tensor each, its element type and its shape (spec §4).

Values only: the segment table's bytes are declared with the rest of the header in
`galahad.format.header`. `spec/format-v1.md` is the normative text, and changes with this module.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import attrs

from galahad.domain.error import FormatError

__all__ = [
    "MAX_NDIM",
    "DType",
    "Segment",
    "SegmentKind",
]

MAX_NDIM = 4

_U16 = (1 << 16) - 1
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class SegmentKind(enum.IntEnum):
    """What a segment holds: paged KV blocks, or a recurrent state (mamba, linear attention)."""

    KV = 0
    STATE = 1


class DType(enum.IntEnum):
    """Element type of a segment. `U8` is also used for raw bytes."""

    U8 = 0
    I8 = 1
    BF16 = 2
    F16 = 3
    F32 = 4
    F8_E4M3FN = 5
    F8_E5M2 = 6
    F8_E4M3FNUZ = 7
    F8_E5M2FNUZ = 8
    I32 = 9
    I64 = 10
    F64 = 11

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def label(self) -> str:
        """The short name used in the spec and by `galahad-format`: `bf16`, `f8_e4m3fn`, ..."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> DType:
        """The dtype named `name`: a label (`bf16`) or a torch name (`bfloat16`, `torch.float16`)."""
        key = name.strip().lower().removeprefix("torch.")
        try:
            return cls[_ALIASES.get(key, key).upper()]
        except KeyError:
            raise FormatError(f"unknown dtype {name!r}") from None


_ALIASES = {
    "uint8": "u8", "int8": "i8", "bfloat16": "bf16", "float16": "f16", "half": "f16",
    "float32": "f32", "float": "f32", "float8_e4m3fn": "f8_e4m3fn", "float8_e5m2": "f8_e5m2",
    "float8_e4m3fnuz": "f8_e4m3fnuz", "float8_e5m2fnuz": "f8_e5m2fnuz", "int32": "i32",
    "int64": "i64", "long": "i64", "float64": "f64", "double": "f64",
}  # fmt: skip

_ITEMSIZE = {
    DType.U8: 1, DType.I8: 1, DType.BF16: 2, DType.F16: 2, DType.F32: 4,
    DType.F8_E4M3FN: 1, DType.F8_E5M2: 1, DType.F8_E4M3FNUZ: 1, DType.F8_E5M2FNUZ: 1,
    DType.I32: 4, DType.I64: 8, DType.F64: 8,
}  # fmt: skip


def _segment_kind(value: int) -> SegmentKind:
    try:
        return SegmentKind(value)
    except ValueError:
        raise FormatError(f"unknown segment kind {value}") from None


def _dtype(value: int | str) -> DType:
    if isinstance(value, str):
        return DType.from_name(value)
    try:
        return DType(value)
    except ValueError:
        raise FormatError(f"unknown dtype code {value}") from None


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _fits(name: str, value: int, top: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= top:
        raise FormatError(f"{name} {value!r} is outside 0..{top}")


@attrs.frozen(cache_hash=True)  # a header's segment table is looked up in a cache by its segments
class Segment:
    """One tensor of the payload: a KV cache group's layer (or state), its dtype and shape."""

    group: int
    kind: SegmentKind = attrs.field(converter=_segment_kind)
    dtype: DType = attrs.field(converter=_dtype)
    layer: int
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    _nbytes: int = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        _fits("segment group", self.group, _U16)
        _fits("segment layer", self.layer, _U32)
        if len(self.shape) > MAX_NDIM:
            raise FormatError(f"a segment has at most {MAX_NDIM} dimensions, got {len(self.shape)}")
        for dim in self.shape:
            _fits("segment dimension", dim, _U64)
        object.__setattr__(self, "_nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Its size in bytes (worked out once: a header sums its segments' on every decode)."""
        return self._nbytes
