"""Sealing and opening block files: the format (spec/format-v1.md) joined to a `Cipher`.

`seal_part` turns a header and one buffer per segment into the chunks of a file. `open_part`
checks a whole file in memory (header, size, what the reader expects, every frame) and returns
the verified payload; `open_part_from` does the same from a `PartReader` (a part held open by a
store), reading each frame straight into its place in the destination and verifying it there,
one frame per task on the pool, so that reads and checks of different frames overlap. Nothing
is returned before every frame verified. Decoding the header and the frame table is
O(segments + frames); sealing and opening are the only passes over the payload. `verify_part`
checks a whole file as `open_part` does and keeps nothing, in memory bounded by one frame.

A header's sizes are not authenticated before its frames verified: they are compared with what
the reader expects (`Expect`: the segment table, the buffer it reads into) before anything is
allocated or iterated by them, and memory the kernel cannot give for a claim is the part's
`FormatError`, never a `MemoryError` (spec §6.1, §6.2).

Both layouts of format v1 are read (spec §2): the aligned one of v1.1, which `seal_part` writes
for a header that asks for it (the default), and the flat one of v1.0.

This module is the codec's one name for its callers; the code is in `part` (what a reader
expects, what it opens to, the ciphers it accepts), `sealing` (the write path), `opening` (a
whole file in memory, and the steps both read paths share) and `reading` (range by range
through a `PartReader`).
"""

from __future__ import annotations

from galahad.format.opening import open_part, read_header, verify_part
from galahad.format.part import CipherLookup, Expect, OpenedPart, cipher_lookup
from galahad.format.reading import (
    NEWER_FORMAT,
    SMALL_SLICE,
    BufferReader,
    header_key,
    open_part_from,
    part_is_whole,
)
from galahad.format.sealing import seal_part, sealed_len
from galahad.format.v1 import DEFAULT_FRAME_SIZE, file_size

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "NEWER_FORMAT",
    "SMALL_SLICE",
    "BufferReader",
    "CipherLookup",
    "Expect",
    "OpenedPart",
    "cipher_lookup",
    "file_size",
    "header_key",
    "open_part",
    "open_part_from",
    "part_is_whole",
    "read_header",
    "seal_part",
    "sealed_len",
    "verify_part",
]
