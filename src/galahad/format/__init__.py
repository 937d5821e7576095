"""The on-disk block format, one module per major version (`v1`), specified in spec/format-v1.md.

Bytes in, values out: no I/O and no encryption here. `checksum` is cipher 0, the keyless frame check.
"""

from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import (
    DEFAULT_FRAME_SIZE,
    INCOMPAT_ALIGNED,
    BlockHeader,
    CipherId,
    DType,
    Frame,
    Segment,
    SegmentKind,
    decode_header,
    encode_header,
    file_size,
    frame_table,
    tag_table_offset,
)

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "INCOMPAT_ALIGNED",
    "BlockHeader",
    "CipherId",
    "DType",
    "Frame",
    "Segment",
    "SegmentKind",
    "Xxh3FrameCheck",
    "decode_header",
    "encode_header",
    "file_size",
    "frame_table",
    "tag_table_offset",
]
