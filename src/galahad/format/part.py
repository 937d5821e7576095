"""A part as the codec sees it: what a reader expects of one, what a verified one opens to, and
which ciphers a reader accepts (the values `sealing`, `opening` and `reading` share)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from galahad.domain.error import FormatError, ForeignBlock
from galahad.format.v1 import BlockHeader, Segment, check_expected_sizes
from galahad.ports.cipher import Cipher

__all__ = [
    "CipherLookup",
    "Expect",
    "OpenedPart",
    "cipher_lookup",
]

CipherLookup = Callable[[int, bytes], Cipher | None]
"""Given a header's cipher id and key id, the cipher to open it with, or None (not accepted)."""


def _segment_table(value: Sequence[Segment] | None) -> tuple[Segment, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class Expect:
    """What a reader expects of a part; a field left None is not checked.

    Another namespace, entry, rank or world is `ForeignBlock`. Another segment table than
    `segments`, or a payload larger than `payload_max` bytes (the buffer the reader has for it),
    is `FormatError`: sizes a header claims are not authenticated before its frames verified,
    and are compared with these before anything is allocated or iterated by them."""

    namespace: bytes | None = None
    chain_key: bytes | None = None
    rank: int | None = None
    world: int | None = None
    segments: tuple[Segment, ...] | None = attrs.field(default=None, converter=_segment_table)
    payload_max: int | None = None

    def check(self, h: BlockHeader) -> None:
        for name in ("namespace", "chain_key", "rank", "world"):
            want, got = getattr(self, name), getattr(h, name)
            if want is not None and got != want:
                raise ForeignBlock(f"{name} is {_show(got)}, expected {_show(want)}")
        check_expected_sizes(h, segments=self.segments, payload_max=self.payload_max)


def _show(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


@attrs.frozen
class OpenedPart:
    """A verified part: its header and its plaintext payload (segments concatenated in table order)."""

    header: BlockHeader
    payload: memoryview

    def segment_views(self) -> list[memoryview]:
        """The payload cut into one view per segment of the header's table (no copies)."""
        views, offset = [], 0
        for segment in self.header.segments:
            views.append(self.payload[offset : offset + segment.nbytes])
            offset += segment.nbytes
        return views


def cipher_lookup(*ciphers: Cipher) -> CipherLookup:
    """A `CipherLookup` accepting exactly these ciphers, matched by (cipher id, key id)."""
    table = {(c.cipher_id, c.key_id): c for c in ciphers}
    return lambda cipher_id, key_id: table.get((cipher_id, key_id))


def _writable_bytes(out: memoryview, need: int, what: str) -> memoryview:
    """The first `need` bytes of a caller's buffer, as bytes: what a part is sealed or opened into."""
    dst = out.cast("B")
    if dst.readonly:
        raise ValueError("the output buffer is read-only")
    if len(dst) < need:
        raise FormatError(f"the {what} is {need} bytes, more than the {len(dst)}-byte buffer")
    return dst[:need]
