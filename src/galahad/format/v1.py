"""Block file format v1: the header and segment table, declared once with construct.

Bytes in, values out: no I/O, no crypto. `spec/format-v1.md` is the normative text; every
number and rule here has a row or a sentence there, and the two change together.

    header  = preamble (24) | fixed fields (136) | segment table (56 x n) | [zeros] | checksum (16)
    payload = segments concatenated in table order, cut into frames of `frame_size` bytes

    aligned layout (incompat flag 0x1, v1.1; what writers write):
    file    = header (padded to a multiple of 4096) | payload (frames back to back) | tag table
    flat layout (v1.0; still read):
    file    = header | frame 0 | tag 0 | frame 1 | tag 1 | ...
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import attrs
import construct as cs
import xxhash

from galahad.domain.error import FormatError, IntegrityError, NewerFormat

__all__ = [
    "Buffer",
    "CHECKSUM_SIZE",
    "DEFAULT_FRAME_SIZE",
    "FIXED_SIZE",
    "INCOMPAT_ALIGNED",
    "MAGIC",
    "MAJOR",
    "MAX_FRAME_SIZE",
    "MAX_HEADER_LEN",
    "MAX_NDIM",
    "MAX_PAYLOAD_LEN",
    "MAX_SEGMENTS",
    "MINOR",
    "MIN_FRAME_SIZE",
    "PAYLOAD_ALIGN",
    "PREAMBLE_SIZE",
    "SEGMENT_SIZE",
    "TAG_SIZE",
    "BlockHeader",
    "CipherId",
    "DType",
    "Frame",
    "Segment",
    "SegmentKind",
    "check_expected_sizes",
    "decode_header",
    "encode_header",
    "file_size",
    "frame_at",
    "frame_table",
    "tag_table_offset",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"GALAHAD\x1a"
MAJOR = 1
MINOR = 1  # 1.1: the aligned layout (incompat flag 0x1)
PREAMBLE_SIZE = 24  # magic, major, minor, flags, header_len: the same in every major version
FIXED_SIZE = 160
SEGMENT_SIZE = 56
CHECKSUM_SIZE = 16
TAG_SIZE = 16
MAX_HEADER_LEN = 1 << 20
MAX_SEGMENTS = 16384
MIN_FRAME_SIZE = 4 << 10
MAX_FRAME_SIZE = 256 << 20
DEFAULT_FRAME_SIZE = 4 << 20
MAX_PAYLOAD_LEN = 1 << 40
MAX_NDIM = 4
INCOMPAT_ALIGNED = 0x1  # v1.1: header padded to PAYLOAD_ALIGN, payload contiguous, tags in a table after it
PAYLOAD_ALIGN = 4096
KNOWN_INCOMPAT_FLAGS = INCOMPAT_ALIGNED  # any other set bit is refused

_U16 = (1 << 16) - 1
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class CipherId(enum.IntEnum):
    """How frames are sealed: a keyless checksum, or AES-256-GCM under a key named by `key_id`."""

    XXH3 = 0
    AES_256_GCM = 1


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

_CIPHER_IDS = frozenset(int(c) for c in CipherId)

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


def _segments(value: Iterable[Segment]) -> tuple[Segment, ...]:
    return tuple(value)


def _fits(name: str, value: int, top: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= top:
        raise FormatError(f"{name} {value!r} is outside 0..{top}")


def _exact(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise FormatError(f"{name} must be exactly {size} bytes")


@attrs.frozen
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


@attrs.frozen
class BlockHeader:
    """The header of one rank's part of one entry. Lengths and the checksum are derived, not stored.

    Writers may leave `cipher_id`, `key_id` and `salt` at their defaults: `codec.seal_part` fills
    them from the cipher and a fresh random salt. The defaults of `minor` and `incompat_flags`
    give the aligned layout (v1.1), which writers always write; `minor=0, incompat_flags=0` gives
    the flat layout of v1.0 (kept for reading old files, and for tests).
    """

    namespace: bytes
    chain_key: bytes
    token_start: int
    token_end: int
    rank: int
    world: int
    block_size: int
    segments: tuple[Segment, ...] = attrs.field(converter=_segments)
    frame_size: int = DEFAULT_FRAME_SIZE
    cipher_id: int = attrs.field(default=CipherId.XXH3, converter=int)
    key_id: bytes = bytes(8)
    salt: bytes = bytes(16)
    minor: int = MINOR
    incompat_flags: int = INCOMPAT_ALIGNED
    compat_flags: int = 0

    def __attrs_post_init__(self) -> None:
        _exact("namespace digest", self.namespace, 32)
        _exact("chain key", self.chain_key, 32)
        _exact("key id", self.key_id, 8)
        _exact("salt", self.salt, 16)
        for name in ("token_start", "token_end"):
            _fits(name, getattr(self, name), _U64)
        for name in ("rank", "world", "block_size", "frame_size", "incompat_flags", "compat_flags"):
            _fits(name, getattr(self, name), _U32)
        _fits("minor version", self.minor, _U16)
        _check_rules(self)

    @property
    def major(self) -> int:
        return MAJOR

    @property
    def aligned(self) -> bool:
        """The aligned layout (incompat flag 0x1): payload contiguous at `header_len`, a multiple
        of 4096, and the tags in a table after it; otherwise v1.0's frame, tag, frame, tag..."""
        return bool(self.incompat_flags & INCOMPAT_ALIGNED)

    @property
    def header_len(self) -> int:
        return _header_len(len(self.segments), self.aligned)

    @functools.cached_property
    def payload_len(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def frame_count(self) -> int:
        """Frames in the file: at least one, so even an empty payload carries a tag."""
        return max(1, -(-self.payload_len // self.frame_size))


def _check_incompat(flags: int) -> None:
    if flags & ~KNOWN_INCOMPAT_FLAGS:
        raise NewerFormat(
            f"incompat flags {flags:#x} include bits this reader does not know "
            "(a file written by a newer Galahad, or a foreign one)"
        )


def _check_rules(h: BlockHeader) -> None:
    _check_incompat(h.incompat_flags)
    if not h.token_start < h.token_end:
        raise FormatError(f"token range [{h.token_start}, {h.token_end}) is empty")
    if not h.rank < h.world:
        raise FormatError(f"rank {h.rank} is not below world size {h.world}")
    if h.block_size < 1:
        raise FormatError("block size must be at least 1")
    if h.cipher_id not in _CIPHER_IDS:
        raise FormatError(f"unknown cipher id {h.cipher_id}")
    if h.cipher_id == CipherId.XXH3 and h.key_id != bytes(8):
        raise FormatError("a checksum-only file (cipher 0) must have an all-zero key id")
    fs = h.frame_size
    if not (MIN_FRAME_SIZE <= fs <= MAX_FRAME_SIZE and fs & (fs - 1) == 0):
        raise FormatError(f"frame size {fs} is not a power of two in [{MIN_FRAME_SIZE}, {MAX_FRAME_SIZE}]")
    if len(h.segments) > MAX_SEGMENTS:
        raise FormatError(f"{len(h.segments)} segments exceed the limit of {MAX_SEGMENTS}")
    if h.payload_len > MAX_PAYLOAD_LEN:
        raise FormatError(f"payload of {h.payload_len} bytes exceeds the limit of {MAX_PAYLOAD_LEN}")


# ---------------------------------------------------------------- the declaration (spec §3, §4)


def _table_end(segment_count: int) -> int:
    return FIXED_SIZE + SEGMENT_SIZE * segment_count


def _header_len(segment_count: int, aligned: bool) -> int:
    """v1.0: the fixed fields, the table and the checksum; aligned: that, rounded up to 4096."""
    n = _table_end(segment_count) + CHECKSUM_SIZE
    return -(-n // PAYLOAD_ALIGN) * PAYLOAD_ALIGN if aligned else n


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


_PREAMBLE = cs.Struct(
    "magic" / cs.Const(MAGIC),
    "major" / cs.Int16ul,
    "minor" / cs.Int16ul,
    "incompat_flags" / cs.Int32ul,
    "compat_flags" / cs.Int32ul,
    "header_len" / cs.Int32ul,
)

_FIXED = cs.Struct(
    *_PREAMBLE.subcons,
    "namespace" / cs.Bytes(32),
    "chain_key" / cs.Bytes(32),
    "token_start" / cs.Int64ul,
    "token_end" / cs.Int64ul,
    "rank" / cs.Int32ul,
    "world" / cs.Int32ul,
    "block_size" / cs.Int32ul,
    "cipher_id" / cs.Int16ul,
    "reserved" / cs.Const(bytes(2)),
    "key_id" / cs.Bytes(8),
    "salt" / cs.Bytes(16),
    "frame_size" / cs.Int32ul,
    "segment_count" / cs.Int32ul,
    "payload_len" / cs.Int64ul,
)

_SEGMENT = cs.Struct(
    "group" / cs.Int16ul,
    "kind" / cs.Int8ul,
    "dtype" / cs.Int8ul,
    "layer" / cs.Int32ul,
    "ndim" / cs.Int8ul,
    "reserved" / cs.Const(bytes(7)),
    "shape" / cs.Array(MAX_NDIM, cs.Int64ul),
    "nbytes" / cs.Int64ul,
)

def _padding_len(this: Any) -> int:
    """The aligned layout's zeros between the segment table and the checksum (none in v1.0's)."""
    aligned = bool(this.incompat_flags & INCOMPAT_ALIGNED)
    return _header_len(this.segment_count, aligned) - CHECKSUM_SIZE - _table_end(this.segment_count)


_BODY = cs.Struct(
    *_FIXED.subcons,
    "segments" / cs.Array(cs.this.segment_count, _SEGMENT),
    "padding" / cs.Padding(_padding_len),
)

_HEADER = cs.Struct(
    "body" / cs.RawCopy(_BODY),
    "checksum" / cs.Checksum(cs.Bytes(CHECKSUM_SIZE), _xxh3_128, cs.this.body.data),
)

class _Flat:
    """A `cs.Struct` of fixed-size fields (little-endian integers, byte strings, constants of
    either) parsed by one `struct.unpack_from` built from the declaration itself: the same values
    and the same `FormatError`s as the declaration's own parse, about 40x faster than its
    compiled form (the preamble and fixed fields are parsed for every part a load opens)."""

    def __init__(self, declaration: cs.Struct) -> None:
        fmt, names, consts = "<", [], {}
        for field in declaration.subcons:
            inner = field.subcon
            if isinstance(inner, cs.Const):
                consts[field.name] = inner.value
                inner = inner.subcon
            if isinstance(inner, cs.FormatField) and inner.fmtstr[0] == "<":
                fmt += inner.fmtstr[1:]
            elif isinstance(inner, cs.Bytes) and isinstance(inner.length, int):
                fmt += f"{inner.length}s"
            else:
                raise TypeError(f"field {field.name!r} is not a fixed-size little-endian integer or byte string")
            names.append(field.name)
        self._struct, self._names, self._consts = struct.Struct(fmt), tuple(names), consts
        if self._struct.size != declaration.sizeof():
            raise TypeError(f"{fmt} is {self._struct.size} bytes, the declaration {declaration.sizeof()}")

    def parse(self, data: bytes, where: str) -> dict[str, Any]:
        if len(data) < self._struct.size:
            raise FormatError(f"malformed header: {where} is {self._struct.size} bytes, got {len(data)}")
        values = dict(zip(self._names, self._struct.unpack_from(data)))
        for name, value in self._consts.items():
            if values[name] != value:
                raise FormatError(f"reserved bytes of {where} are not zero")
        return values


_PREAMBLE_FLAT = _Flat(_PREAMBLE)
_FIXED_FLAT = _Flat(_FIXED)

# The same declarations, compiled to Python source by construct: about 10x faster to parse and
# build. `_HEADER` is the whole header; the code builds and parses it in its pieces (the fixed
# fields, then each table entry, then the checksum over both), which give the same bytes
# (tests/property/test_format_roundtrip.py checks it against `_HEADER.build`).
_FIXED_FAST = _FIXED.compile()
_SEGMENT_FAST = _SEGMENT.compile()
_TABLES_KEPT = 64  # segment tables cached each way: every part of a model has the same table


# ---------------------------------------------------------------- values <-> containers


def _segment_dict(s: Segment) -> dict[str, Any]:
    shape = list(s.shape) + [0] * (MAX_NDIM - len(s.shape))
    return dict(group=s.group, kind=s.kind, dtype=s.dtype, layer=s.layer, ndim=len(s.shape), shape=shape, nbytes=s.nbytes)


def _segment_from(index: int, c: Any) -> Segment:
    if c.ndim > MAX_NDIM:
        raise FormatError(f"segment {index}: {c.ndim} dimensions, at most {MAX_NDIM}")
    if any(c.shape[c.ndim :]):
        raise FormatError(f"segment {index}: unused shape entries must be zero")
    seg = Segment(group=c.group, kind=c.kind, dtype=c.dtype, layer=c.layer, shape=c.shape[: c.ndim])
    if seg.nbytes != c.nbytes:
        raise FormatError(f"segment {index}: byte length {c.nbytes} is not shape x dtype size ({seg.nbytes})")
    return seg


_FIELDS = ("namespace", "chain_key", "token_start", "token_end", "rank", "world", "block_size",
           "frame_size", "cipher_id", "key_id", "salt", "minor", "incompat_flags", "compat_flags")  # fmt: skip


def encode_header(h: BlockHeader) -> bytes:
    """The header bytes of `h`, with its lengths, segment table and checksum."""
    body = {name: getattr(h, name) for name in _FIELDS}
    body.update(major=MAJOR, header_len=h.header_len, segment_count=len(h.segments), payload_len=h.payload_len)
    try:
        raw: bytes = _FIXED_FAST.build(body) + _encode_table(h.segments)
    except cs.ConstructError as exc:  # values were validated; this would be a bug in the declaration
        raise FormatError(f"cannot encode header: {_one_line(exc)}") from exc
    raw += bytes(h.header_len - CHECKSUM_SIZE - len(raw))  # the aligned layout's zero padding
    return raw + _xxh3_128(raw)


@functools.lru_cache(maxsize=_TABLES_KEPT)
def _encode_table(segments: tuple[Segment, ...]) -> bytes:
    """The segment table of `segments` (cached: building it is most of a header's encoding)."""
    return b"".join(_SEGMENT_FAST.build(_segment_dict(s)) for s in segments)


def decode_header(buf: Buffer) -> BlockHeader:
    """Decode and validate the header at the start of `buf` (a whole file or just its head).

    Reads only `buf[:header_len]`: O(segments), never the payload. Raises `FormatError` for
    anything that is not a v1 header we accept, `IntegrityError` for a bad checksum or a header
    cut short.
    """
    head = bytes(buf[:PREAMBLE_SIZE])
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise FormatError("not a Galahad block (no Galahad magic at the start)")
    if len(head) < PREAMBLE_SIZE:
        raise IntegrityError(f"truncated header: {len(head)} bytes")
    pre = _PREAMBLE_FLAT.parse(head, "the fixed header")
    if pre["major"] > MAJOR:
        raise NewerFormat(f"format major version {pre['major']}; this reader reads major {MAJOR} only")
    if pre["major"] != MAJOR:
        raise FormatError(f"format major version {pre['major']}; this reader reads major {MAJOR} only")
    n = pre["header_len"]
    if not _header_len(0, False) <= n <= MAX_HEADER_LEN:
        raise FormatError(f"header length {n} is outside [{_header_len(0, False)}, {MAX_HEADER_LEN}]")
    if len(buf) < n:
        raise IntegrityError(f"truncated header: {len(buf)} bytes, the header alone is {n}")
    raw = bytes(buf[:n])
    if _xxh3_128(raw[:-CHECKSUM_SIZE]) != raw[-CHECKSUM_SIZE:]:
        raise IntegrityError("header checksum does not match: the header is damaged")
    fixed = _FIXED_FLAT.parse(raw, "the fixed header")
    _check_incompat(fixed["incompat_flags"])  # before the table: a new flag may change its layout
    count, aligned = fixed["segment_count"], bool(fixed["incompat_flags"] & INCOMPAT_ALIGNED)
    if count > MAX_SEGMENTS:
        raise FormatError(f"{count} segments exceed the limit of {MAX_SEGMENTS}")
    if n != _header_len(count, aligned):
        layout = "aligned " if aligned else ""
        raise FormatError(f"header length {n} does not match its segment count ({count}) in the {layout}layout")
    end = _table_end(count)
    padding = raw[end:-CHECKSUM_SIZE]
    if padding.count(0) != len(padding):
        raise FormatError("the header's padding is not zero")
    segments, payload_len = _decode_table(raw[FIXED_SIZE:end])
    if fixed["payload_len"] != payload_len:
        raise FormatError(
            f"payload length {fixed['payload_len']} is not the sum of the segment lengths ({payload_len})"
        )
    return _decoded(fixed, segments, payload_len)


def _decoded(fixed: dict[str, Any], segments: tuple[Segment, ...], payload_len: int) -> BlockHeader:
    """The `BlockHeader` of fields a header decoded to, checked by the format's rules only.

    What `BlockHeader`'s own checks add holds here by construction: each field was unpacked
    from a fixed-width one (a 32-byte string is 32 bytes, a u32 fits in 32 bits), and `segments`
    come validated from `_decode_table`. Skipping them matters because a load decodes a header
    right after streaming megabytes through the caches, where every Python step is a cache miss."""
    h: BlockHeader = object.__new__(BlockHeader)
    for name in _FIELDS:
        object.__setattr__(h, name, fixed[name])
    object.__setattr__(h, "segments", segments)
    object.__setattr__(h, "payload_len", payload_len)
    _check_rules(h)
    return h


@functools.lru_cache(maxsize=_TABLES_KEPT)
def _decode_table(table: bytes) -> tuple[tuple[Segment, ...], int]:
    """The segments of a table and the sum of their lengths (whole entries; cached by its
    bytes: a table that fails is not kept)."""
    entries = range(0, len(table), SEGMENT_SIZE)
    segments = tuple(
        _segment_from(i, _parse(_SEGMENT_FAST, table[at : at + SEGMENT_SIZE], "a segment entry"))
        for i, at in enumerate(entries)
    )
    return segments, sum(s.nbytes for s in segments)


def _parse(struct: cs.Construct, data: bytes, where: str = "the fixed header") -> Any:
    try:
        return struct.parse(data)
    except cs.ChecksumError as exc:
        raise IntegrityError("header checksum does not match: the header is damaged") from exc
    except cs.ConstError as exc:
        raise FormatError(f"reserved bytes of {where} are not zero") from exc
    except cs.ConstructError as exc:
        raise FormatError(f"malformed header: {_one_line(exc)}") from exc


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------- what a reader expects (spec §6.1 step 11)


def check_expected_sizes(
    h: BlockHeader, *, segments: tuple[Segment, ...] | None = None, payload_max: int | None = None
) -> None:
    """`FormatError` unless the sizes `h` claims are those the reader expects: its segment table
    is `segments` (when given), hence its payload length and frame count are what follow from
    that table; and its payload is at most `payload_max` bytes (when given: the largest the
    reader can take, such as the buffer it reads into).

    The header is not authenticated yet (a sealed file's tags are checked last, step 13), so
    these claims must not size an allocation or a loop before they are compared with what the
    reader knows on its own. O(segments), no allocation."""
    if segments is not None and h.segments != segments:
        raise FormatError(
            f"the segment table ({len(h.segments)} segments, {h.payload_len} payload bytes) is not the one "
            f"this reader expects ({len(segments)} segments, {sum(s.nbytes for s in segments)} bytes)"
        )
    if payload_max is not None and h.payload_len > payload_max:
        raise FormatError(
            f"the header claims a payload of {h.payload_len} bytes in {h.frame_count} frame(s), more than the "
            f"{payload_max} bytes this reader expects at most"
        )


# ---------------------------------------------------------------- frames (spec §5)


@attrs.frozen
class Frame:
    """Where frame `index` lies: in the plaintext payload, and in the file (its stored bytes at
    `data_offset`, `plain_len` long, and its 16-byte tag at `tag_offset`)."""

    index: int
    plain_offset: int
    plain_len: int
    data_offset: int
    tag_offset: int


def frame_table(h: BlockHeader) -> Iterator[Frame]:
    """Every frame of a file with header `h`, in order. Lazy: O(1) memory, O(frames) time."""
    for i in range(h.frame_count):
        yield frame_at(h, i)


def frame_at(h: BlockHeader, index: int) -> Frame:
    """Where frame `index` (0 to `frame_count - 1`) of a file with header `h` lies. O(1).

    Aligned layout: frame i's bytes at `header_len + i * frame_size`, its tag at
    `header_len + payload_len + 16 * i`. Flat layout (v1.0): `header_len + i * (frame_size + 16)`,
    the tag right after the bytes.
    """
    if not 0 <= index < h.frame_count:
        raise IndexError(f"frame {index} of {h.frame_count}")
    fs, total, base = h.frame_size, h.payload_len, h.header_len
    start = index * fs
    length = min(fs, total - start)
    if h.aligned:
        return Frame(index, start, length, base + start, base + total + index * TAG_SIZE)
    at = base + start + index * TAG_SIZE
    return Frame(index, start, length, at, at + length)


def tag_table_offset(h: BlockHeader) -> int | None:
    """Where the aligned layout's tag table starts (`frame_count` tags of 16 bytes, to the end of
    the file); None in the flat layout, whose tags follow their frames."""
    return h.header_len + h.payload_len if h.aligned else None


def file_size(h: BlockHeader) -> int:
    """The exact size of a file with header `h`; any other size is truncated or has trailing bytes.
    The same in both layouts: header, payload and one tag per frame, with no gaps."""
    return h.header_len + h.payload_len + TAG_SIZE * h.frame_count
