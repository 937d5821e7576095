"""Decoding the header and frame table of a 64 MiB part never touches its payload.

`decode_header` and `frame_table` are O(segments + frames): a buffer that records every range
read shows that nothing past the header is read; `read_header` accepts a file whose frames are
garbage (it never looks at them) without copying it.
"""

from __future__ import annotations

import tracemalloc

from galahad.format.codec import read_header
from galahad.format.v1 import BlockHeader, DType, Segment, SegmentKind, decode_header, encode_header, file_size, frame_table

MiB = 1 << 20


class ReadRecorder:
    """A stand-in for a file's bytes that records every range read; only the header exists."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size = head, size
        self.reads: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, _ = key.indices(self.size)
        self.reads.append((start, stop))
        return self.head[start:stop] + bytes(max(0, stop - max(start, len(self.head))))


def _header(payload_mib: int) -> BlockHeader:
    layers = [Segment(0, SegmentKind.KV, DType.BF16, layer, (2, 16, 64, 256)) for layer in range(payload_mib)]
    return BlockHeader(namespace=b"n" * 32, chain_key=b"k" * 32, token_start=0, token_end=256, rank=0, world=1,
                       block_size=16, segments=layers, frame_size=4 * MiB)


def test_header_and_frame_table_of_64_mib_read_only_the_header() -> None:
    h = _header(64)
    assert h.payload_len == 64 * MiB
    recorder = ReadRecorder(encode_header(h), file_size(h))
    assert decode_header(recorder) == h  # type: ignore[arg-type]
    frames = list(frame_table(h))
    assert max(stop for _, stop in recorder.reads) <= h.header_len
    assert len(frames) == 16
    assert frames[-1].tag_offset + 16 == recorder.size  # the aligned layout: the last tag ends the file
    assert frames[-1].data_offset + frames[-1].plain_len == h.header_len + h.payload_len


def test_read_header_of_64_mib_neither_reads_nor_copies_the_frames() -> None:
    h = _header(64)
    blob = bytearray(file_size(h))  # frames of zeros: not one tag would verify
    blob[: h.header_len] = encode_header(h)
    tracemalloc.start()
    try:
        assert read_header(blob) == h
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB
