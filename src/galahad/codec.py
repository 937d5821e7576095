"""Sealing and opening block files: the format (spec/format-v1.md) joined to a `Cipher`.

`seal_part` turns a header and one buffer per segment into the chunks of a file; `open_part`
checks a whole file (header, size, what the reader expects, every frame) and returns the
verified payload. Nothing is returned before every frame verified. Decoding the header and
the frame table is O(segments + frames); sealing and opening are the only passes over the payload.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from galahad.domain.error import FormatError, ForeignBlock, IntegrityError, UnknownKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import (
    DEFAULT_FRAME_SIZE,
    BlockHeader,
    Buffer,
    CipherId,
    Frame,
    decode_header,
    encode_header,
    file_size,
    frame_table,
)
from galahad.ports.cipher import Cipher

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "CipherLookup",
    "Expect",
    "OpenedPart",
    "cipher_lookup",
    "open_part",
    "read_header",
    "seal_part",
]

CipherLookup = Callable[[int, bytes], Cipher | None]
"""Given a header's cipher id and key id, the cipher to open it with, or None (not accepted)."""


@runtime_checkable
class _SealsInto(Protocol):
    """A cipher that can seal a frame into a caller's buffer (saves a copy per frame)."""

    def seal_frame_into(self, salt: bytes, aad: bytes, index: int, data: Buffer, out: memoryview) -> int: ...


@runtime_checkable
class _OpensInto(Protocol):
    """A cipher that can open a frame into a caller's buffer (saves a copy per frame)."""

    def open_frame_into(self, salt: bytes, aad: bytes, index: int, sealed: Buffer, out: memoryview) -> int: ...


@attrs.frozen
class Expect:
    """What a reader expects of a part; a field left None is not checked. A mismatch is `ForeignBlock`."""

    namespace: bytes | None = None
    chain_key: bytes | None = None
    rank: int | None = None
    world: int | None = None

    def check(self, h: BlockHeader) -> None:
        for name in ("namespace", "chain_key", "rank", "world"):
            want, got = getattr(self, name), getattr(h, name)
            if want is not None and got != want:
                raise ForeignBlock(f"{name} is {_show(got)}, expected {_show(want)}")


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


# ---------------------------------------------------------------- writing


def seal_part(
    header: BlockHeader,
    payload: Sequence[Buffer],
    cipher: Cipher,
    *,
    pool: cf.Executor | None = None,
    salt: bytes | None = None,
) -> list[Buffer]:
    """The chunks of a file for `header` and `payload` (one buffer per segment), to write in order.

    The header's cipher id and key id are taken from `cipher`, its salt is `salt` or 16 fresh
    random bytes. Frames are sealed on `pool` (a thread pool) when given. The chunks may be views
    of `payload`: keep it unchanged until they are written.
    """
    h = attrs.evolve(
        header, cipher_id=cipher.cipher_id, key_id=cipher.key_id, salt=os.urandom(16) if salt is None else salt
    )
    views = _payload_views(h, payload)
    starts = list(itertools.accumulate((len(v) for v in views), initial=0))[:-1]
    aad = encode_header(h)

    def seal(frame: Frame) -> list[Buffer]:
        pieces = _pieces(views, starts, frame.plain_offset, frame.plain_len)
        if isinstance(cipher, Xxh3FrameCheck):  # the plaintext is stored as is: no copy
            return [*pieces, cipher.tag(h.salt, aad, frame.index, pieces)]
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if isinstance(cipher, _SealsInto):
            sealed = memoryview(bytearray(frame.sealed_len))
            cipher.seal_frame_into(h.salt, aad, frame.index, data, sealed)
            return [sealed]
        return [cipher.seal_frame(h.salt, aad, frame.index, data)]

    frames = frame_table(h)
    sealed = map(seal, frames) if pool is None else pool.map(seal, frames)
    return [aad, *itertools.chain.from_iterable(sealed)]


def _payload_views(h: BlockHeader, payload: Sequence[Buffer]) -> list[memoryview]:
    if len(payload) != len(h.segments):
        raise FormatError(f"{len(payload)} payload buffers for {len(h.segments)} segments")
    views = [memoryview(buf).cast("B") for buf in payload]
    for index, (view, segment) in enumerate(zip(views, h.segments)):
        if len(view) != segment.nbytes:
            raise FormatError(f"segment {index}: {len(view)} bytes given, its shape and dtype make {segment.nbytes}")
    return views


def _pieces(views: list[memoryview], starts: list[int], offset: int, length: int) -> list[memoryview]:
    """Views of the payload bytes `[offset, offset + length)`, which may span several segments."""
    out: list[memoryview] = []
    end = offset + length
    index = bisect.bisect_right(starts, offset) - 1
    while offset < end:
        view, start = views[index], starts[index]
        take = min(end, start + len(view)) - offset
        if take > 0:
            out.append(view[offset - start : offset - start + take])
            offset += take
        index += 1
    return out


# ---------------------------------------------------------------- reading


def read_header(blob: Buffer) -> BlockHeader:
    """The header of a whole file, checked (checksum, rules, exact file size) but no frame opened."""
    view = memoryview(blob).cast("B")
    h = decode_header(view)
    size = file_size(h)
    if len(view) < size:
        raise IntegrityError(f"truncated: the file is {len(view)} bytes, its header says {size}")
    if len(view) > size:
        raise IntegrityError(f"trailing bytes: the file is {len(view)} bytes, its header says {size}")
    return h


def open_part(
    blob: Buffer,
    *,
    expect: Expect,
    ciphers: CipherLookup,
    pool: cf.Executor | None = None,
    out: memoryview | None = None,
) -> OpenedPart:
    """Verify a whole file and return its plaintext payload (in `out` when given).

    Raises `FormatError` (malformed, future), `IntegrityError` (damaged, truncated),
    `ForeignBlock` (not what `expect` says), `UnknownKey` (`ciphers` has nothing for it).
    After a raise, `out` holds no meaningful bytes.
    """
    view = memoryview(blob).cast("B")
    h = read_header(view)
    expect.check(h)
    cipher = ciphers(h.cipher_id, h.key_id)
    if cipher is None:
        if h.cipher_id == CipherId.XXH3:
            raise UnknownKey("a checksum-only file (cipher 0), and this reader accepts sealed files only")
        raise UnknownKey(f"sealed under key id {h.key_id.hex()}, which this reader does not hold")
    dst = _destination(h, out)
    aad = bytes(view[: h.header_len])

    def open_frame(frame: Frame) -> None:
        sealed = view[frame.file_offset : frame.file_offset + frame.sealed_len]
        target = dst[frame.plain_offset : frame.plain_offset + frame.plain_len]
        if isinstance(cipher, _OpensInto):  # straight into dst: no copy beyond the cipher's own
            size = cipher.open_frame_into(h.salt, aad, frame.index, sealed, target)
        else:
            plain = cipher.open_frame(h.salt, aad, frame.index, sealed)
            size = len(plain)
            if size == frame.plain_len:
                target[:] = plain
        if size != frame.plain_len:
            raise IntegrityError(f"frame {frame.index} opened to {size} bytes, expected {frame.plain_len}")

    _run(open_frame, frame_table(h), pool)
    return OpenedPart(h, dst)


def _destination(h: BlockHeader, out: memoryview | None) -> memoryview:
    if out is None:
        return memoryview(bytearray(h.payload_len))
    dst = out.cast("B")
    if dst.readonly:
        raise ValueError("the output buffer is read-only")
    if len(dst) < h.payload_len:
        raise FormatError(f"the payload is {h.payload_len} bytes, more than the {len(dst)}-byte buffer")
    return dst[: h.payload_len]


def _run(work: Callable[[Frame], None], frames: Iterable[Frame], pool: cf.Executor | None) -> None:
    """Run `work` on every frame; on a pool, wait for all before raising the first failure."""
    if pool is None:
        for frame in frames:
            work(frame)
        return
    futures = [pool.submit(work, frame) for frame in frames]
    cf.wait(futures)
    for future in futures:
        future.result()
