"""The on-disk block format, one module per major version (`v1`), specified in spec/format-v1.md.

Bytes in, values out: no I/O and no encryption here. `v1` is the file layout and the version's
public names; the header (value, construct declaration, encoding) is in `header`, its segments in
`segment`. `codec` seals and opens parts with a cipher (`sealing`, `opening`, `reading`, `part`);
`checksum` is cipher 0, the keyless frame check.
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
