"""Block file format v1: the file's layout, frames and tags around the header.

Bytes in, values out: no I/O, no crypto. `spec/format-v1.md` is the normative text; every
number and rule here has a row or a sentence there, and the two change together. The header
(its value, its construct declaration, `encode_header` and `decode_header`) is in
`galahad.format.header`, the segments in `galahad.format.segment`; their public names are
also here, the format's version 1 in one namespace.

    header  = preamble (24) | fixed fields (136) | segment table (56 x n) | [zeros] | checksum (16)
    payload = segments concatenated in table order, cut into frames of `frame_size` bytes

    aligned layout (incompat flag 0x1, v1.1; what writers write):
    file    = header (padded to a multiple of 4096) | payload (frames back to back) | tag table
    flat layout (v1.0; still read):
    file    = header | frame 0 | tag 0 | frame 1 | tag 1 | ...
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from galahad.domain.error import FormatError
from galahad.format.header import (
    CHECKSUM_SIZE,
    DEFAULT_FRAME_SIZE,
    FIXED_SIZE,
    INCOMPAT_ALIGNED,
    KNOWN_INCOMPAT_FLAGS,
    MAGIC,
    MAJOR,
    MAX_FRAME_SIZE,
    MAX_HEADER_LEN,
    MAX_PAYLOAD_LEN,
    MAX_SEGMENTS,
    MIN_FRAME_SIZE,
    MINOR,
    PAYLOAD_ALIGN,
    PREAMBLE_SIZE,
    SEGMENT_SIZE,
    BlockHeader,
    Buffer,
    CipherId,
    decode_header,
    decode_key,
    encode_header,
)
from galahad.format.segment import MAX_NDIM, DType, Segment, SegmentKind

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
    "decode_key",
    "encode_header",
    "file_size",
    "frame_at",
    "frame_table",
    "tag_table_offset",
]

TAG_SIZE = 16


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
