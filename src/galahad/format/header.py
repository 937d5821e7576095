"""The v1 block header: its value, its construct declaration, and its encoding both ways.

Bytes in, values out: no I/O, no crypto. `spec/format-v1.md` is the normative text (§3 the
header, §4 the segment table, §6.1 the order of checks); every number and rule here has a row or
a sentence there, and the two change together.

    header = preamble (24) | fixed fields (136) | segment table (56 x n) | [zeros] | checksum (16)

The header is declared once, with construct (`_HEADER`, made of `_FIXED` and `_SEGMENT`).
`encode_header` builds it and `decode_header` parses it with those declarations compiled by
construct, piece by piece in the order of the spec's checks, and a decoded header is a
`BlockHeader` built through its class, so every check of the value runs on the way in as on the
way out.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import attrs
import construct as cs
import xxhash

from galahad.domain.error import FormatError, IntegrityError, NewerFormat
from galahad.format.segment import _U16, _U32, _U64, MAX_NDIM, Segment, _fits

__all__ = [
    "Buffer",
    "CHECKSUM_SIZE",
    "DEFAULT_FRAME_SIZE",
    "FIXED_SIZE",
    "INCOMPAT_ALIGNED",
    "KNOWN_INCOMPAT_FLAGS",
    "MAGIC",
    "MAJOR",
    "MAX_FRAME_SIZE",
    "MAX_HEADER_LEN",
    "MAX_PAYLOAD_LEN",
    "MAX_SEGMENTS",
    "MINOR",
    "MIN_FRAME_SIZE",
    "PAYLOAD_ALIGN",
    "PREAMBLE_SIZE",
    "SEGMENT_SIZE",
    "BlockHeader",
    "CipherId",
    "decode_header",
    "decode_key",
    "encode_header",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"GALAHAD\x1a"
MAJOR = 1
MINOR = 1  # 1.1: the aligned layout (incompat flag 0x1)
PREAMBLE_SIZE = 24  # magic, major, minor, flags, header_len: the same in every major version
FIXED_SIZE = 160
SEGMENT_SIZE = 56
CHECKSUM_SIZE = 16
MAX_HEADER_LEN = 1 << 20
MAX_SEGMENTS = 16384
MIN_FRAME_SIZE = 4 << 10
MAX_FRAME_SIZE = 256 << 20
DEFAULT_FRAME_SIZE = 4 << 20
MAX_PAYLOAD_LEN = 1 << 40
INCOMPAT_ALIGNED = 0x1  # v1.1: header padded to PAYLOAD_ALIGN, payload contiguous, tags in a table after it
PAYLOAD_ALIGN = 4096
KNOWN_INCOMPAT_FLAGS = INCOMPAT_ALIGNED  # any other set bit is refused


class CipherId(enum.IntEnum):
    """How frames are sealed: a keyless checksum, or AES-256-GCM under a key named by `key_id`."""

    XXH3 = 0
    AES_256_GCM = 1


_CIPHER_IDS = frozenset(int(c) for c in CipherId)


def _segments(value: Iterable[Segment]) -> tuple[Segment, ...]:
    return tuple(value)


def _exact(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise FormatError(f"{name} must be exactly {size} bytes")


@attrs.frozen
class BlockHeader:
    """The header of one rank's part of one entry. Lengths and the checksum are derived, not stored.

    Writers may leave `cipher_id`, `key_id` and `salt` at their defaults: `sealing.seal_part`
    fills them from the cipher and a fresh random salt. The defaults of `minor` and
    `incompat_flags` give the aligned layout (v1.1), which writers always write;
    `minor=0, incompat_flags=0` gives the flat layout of v1.0 (kept for reading old files, and
    for tests).
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


class _Compiled:
    """A fixed-size piece of the declaration, compiled to Python source by construct (its parse
    about 4x faster than the declaration's own), with the format's errors: input cut short, or a
    constant (magic, reserved bytes) that is not what it must be, is a `FormatError`."""

    def __init__(self, declaration: cs.Struct) -> None:
        self._fast = declaration.compile()
        self.size: int = declaration.sizeof()

    def parse(self, data: bytes, where: str) -> Mapping[str, Any]:
        if len(data) < self.size:
            raise FormatError(f"malformed header: {where} is {self.size} bytes, got {len(data)}")
        try:
            values: Mapping[str, Any] = self._fast.parse(data)
        except cs.ConstError as exc:
            raise FormatError(f"reserved bytes of {where} are not zero") from exc
        except cs.ConstructError as exc:
            raise FormatError(f"malformed header: {_one_line(exc)}") from exc
        return values

    def build(self, values: Mapping[str, Any]) -> bytes:
        try:
            built: bytes = self._fast.build(values)
        except cs.ConstructError as exc:  # values were validated; this would be a bug in the declaration
            raise FormatError(f"cannot encode header: {_one_line(exc)}") from exc
        return built


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# `_HEADER` is the whole header; the code builds and parses it in its pieces (the preamble, the
# fixed fields, then each table entry, then the checksum over them), which give the same bytes
# (tests/property/test_format_roundtrip.py checks it against `_HEADER.build`) and let a reader
# take the spec's checks in their order: the checksum and the incompat flags before the table.
_PREAMBLE_FAST = _Compiled(_PREAMBLE)
_FIXED_FAST = _Compiled(_FIXED)
_SEGMENT_FAST = _Compiled(_SEGMENT)
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
    raw = _FIXED_FAST.build(body) + _encode_table(h.segments)
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
    raw, fixed = _checked_fixed(buf)
    _check_incompat(fixed["incompat_flags"])  # before the table: a new flag may change its layout
    count, aligned = fixed["segment_count"], bool(fixed["incompat_flags"] & INCOMPAT_ALIGNED)
    if count > MAX_SEGMENTS:
        raise FormatError(f"{count} segments exceed the limit of {MAX_SEGMENTS}")
    n = len(raw)
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
    return _decoded(fixed, segments)


def decode_key(buf: Buffer) -> tuple[int, bytes]:
    """The cipher id and key id of the header at the start of `buf`, after the checks of
    `decode_header` up to its checksum (the same errors), without decoding its segment table:
    what a reader asks before choosing to open a part, at a fraction of the cost."""
    _raw, fixed = _checked_fixed(buf)
    _check_incompat(fixed["incompat_flags"])
    return int(fixed["cipher_id"]), bytes(fixed["key_id"])


def _checked_fixed(buf: Buffer) -> tuple[bytes, Mapping[str, Any]]:
    """The header's bytes and its fixed fields, its magic, major version, length and checksum
    checked (`decode_header`'s first checks)."""
    head = bytes(buf[:PREAMBLE_SIZE])
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise FormatError("not a Galahad block (no Galahad magic at the start)")
    if len(head) < PREAMBLE_SIZE:
        raise IntegrityError(f"truncated header: {len(head)} bytes")
    pre = _PREAMBLE_FAST.parse(head, "the fixed header")
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
    return raw, _FIXED_FAST.parse(raw, "the fixed header")


def _decoded(fixed: Mapping[str, Any], segments: tuple[Segment, ...]) -> BlockHeader:
    """The `BlockHeader` of the fields a header decoded to, built through its class: every check
    of the value (widths, the format's rules) runs on a header read as on one written."""
    return BlockHeader(segments=segments, **{name: fixed[name] for name in _FIELDS})


@functools.lru_cache(maxsize=_TABLES_KEPT)
def _decode_table(table: bytes) -> tuple[tuple[Segment, ...], int]:
    """The segments of a table and the sum of their lengths (whole entries; cached by its
    bytes: a table that fails is not kept)."""
    entries = range(0, len(table), SEGMENT_SIZE)
    segments = tuple(
        _segment_from(i, _SEGMENT_FAST.parse(table[at : at + SEGMENT_SIZE], "a segment entry"))
        for i, at in enumerate(entries)
    )
    return segments, sum(s.nbytes for s in segments)
