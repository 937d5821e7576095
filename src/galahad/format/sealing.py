"""Sealing a part: a header and one buffer per segment turned into the chunks of a block file.

`seal_part` seals every frame of the payload with a `Cipher` (on a pool when given) and returns
the file's chunks to write in order: the header, then, in the aligned layout of v1.1 (which it
writes for a header that asks for it, the default), the payload in one piece and the tag table,
or in the flat layout of v1.0 each frame followed by its tag (spec §2, §5, §10). Sealing is the
only pass over the payload; the checksum (cipher 0) stores the caller's buffers as they are.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from galahad.domain.error import FormatError
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.part import _writable_bytes
from galahad.format.v1 import TAG_SIZE, BlockHeader, Buffer, Frame, encode_header, file_size, frame_table
from galahad.ports.cipher import Cipher

__all__ = [
    "seal_part",
    "sealed_len",
]


@runtime_checkable
class _SealsPiecesInto(Protocol):
    """A cipher that can seal a frame given in pieces into a caller's buffer (no join, no copy)."""

    def seal_pieces_into(
        self, salt: bytes, aad: bytes, index: int, pieces: Sequence[Buffer], out: memoryview
    ) -> int: ...


@runtime_checkable
class _SealsInto(Protocol):
    """A cipher that can seal a frame into a caller's buffer (saves a copy per frame)."""

    def seal_frame_into(self, salt: bytes, aad: bytes, index: int, data: Buffer, out: memoryview) -> int: ...


@runtime_checkable
class _SealsDetached(Protocol):
    """A cipher that seals a frame given in pieces with its ciphertext and its tag in two places
    (the aligned layout keeps the tags in a table after the payload)."""

    def seal_detached_into(
        self, salt: bytes, aad: bytes, index: int, pieces: Sequence[Buffer], out: memoryview, tag: memoryview
    ) -> int: ...


def sealed_len(header: BlockHeader) -> int:
    """The bytes of a file with `header` after its header: frames and their tags (`seal_part`'s `out`)."""
    return file_size(header) - header.header_len


def seal_part(
    header: BlockHeader,
    payload: Sequence[Buffer],
    cipher: Cipher,
    *,
    pool: cf.Executor | None = None,
    salt: bytes | None = None,
    out: memoryview | None = None,
) -> list[Buffer]:
    """The chunks of a file for `header` and `payload` (one buffer per segment), to write in order.

    The header's cipher id and key id are taken from `cipher`, its salt is `salt` or 16 fresh
    random bytes. Frames are sealed on `pool` (a thread pool) when given. The chunks may be views
    of `payload`: keep it unchanged until they are written. A cipher that transforms the bytes
    (AES-GCM) writes the sealed frames into `out` when given (at least `sealed_len(header)`
    bytes, reused by the caller: no allocation per frame), and the chunks are then views of it:
    keep it too until they are written. The checksum (cipher 0) stores the payload as it is and
    never uses `out`.
    """
    h = attrs.evolve(
        header, cipher_id=cipher.cipher_id, key_id=cipher.key_id, salt=os.urandom(16) if salt is None else salt
    )
    views = _payload_views(h, payload)
    starts = list(itertools.accumulate((len(v) for v in views), initial=0))[:-1]
    aad = encode_header(h)
    if out is not None:
        out = _writable_bytes(out, sealed_len(h), "sealed frames")
    if h.aligned:
        return [aad, *_seal_aligned(h, aad, views, starts, cipher, pool, out)]

    def pieces(frame: Frame) -> list[memoryview]:
        return _pieces(views, starts, frame.plain_offset, frame.plain_len)

    def target(frame: Frame) -> memoryview:
        if out is None:
            return memoryview(bytearray(frame.plain_len + TAG_SIZE))
        start = frame.data_offset - h.header_len
        return out[start : start + frame.plain_len + TAG_SIZE]

    seal: Callable[[Frame], list[Buffer]]
    if isinstance(cipher, Xxh3FrameCheck):  # the plaintext is stored as is: no copy

        def seal(frame: Frame) -> list[Buffer]:
            data = pieces(frame)
            return [*data, cipher.tag(h.salt, aad, frame.index, data)]

    elif isinstance(cipher, _SealsPiecesInto):  # no join: the cipher streams over the pieces

        def seal(frame: Frame) -> list[Buffer]:
            sealed = target(frame)
            cipher.seal_pieces_into(h.salt, aad, frame.index, pieces(frame), sealed)
            return [sealed]

    elif isinstance(cipher, _SealsInto):

        def seal(frame: Frame) -> list[Buffer]:
            data, sealed = pieces(frame), target(frame)
            cipher.seal_frame_into(h.salt, aad, frame.index, data[0] if len(data) == 1 else b"".join(data), sealed)
            return [sealed]

    else:

        def seal(frame: Frame) -> list[Buffer]:
            data = pieces(frame)
            return [cipher.seal_frame(h.salt, aad, frame.index, data[0] if len(data) == 1 else b"".join(data))]

    frames = frame_table(h)
    sealed = map(seal, frames) if pool is None else pool.map(seal, frames)
    return [aad, *itertools.chain.from_iterable(sealed)]


def _seal_aligned(
    h: BlockHeader,
    aad: bytes,
    views: list[memoryview],
    starts: list[int],
    cipher: Cipher,
    pool: cf.Executor | None,
    out: memoryview | None,
) -> list[Buffer]:
    """The chunks after the header in the aligned layout: the stored payload, then the tag table.

    The checksum stores the caller's buffers as they are (no copy) and only computes the tags; a
    cipher writes the ciphertext into `out[:payload_len]` and the tags into the rest of `out`.
    """
    frames = frame_table(h)

    def pieces(frame: Frame) -> list[memoryview]:
        return _pieces(views, starts, frame.plain_offset, frame.plain_len)

    if isinstance(cipher, Xxh3FrameCheck):
        tags = map(lambda f: cipher.tag(h.salt, aad, f.index, pieces(f)), frames) if pool is None else pool.map(
            lambda f: cipher.tag(h.salt, aad, f.index, pieces(f)), frames
        )
        return [*views, b"".join(tags)]
    total = h.payload_len
    sealed = memoryview(bytearray(sealed_len(h))) if out is None else out

    def seal(frame: Frame) -> None:
        data = sealed[frame.plain_offset : frame.plain_offset + frame.plain_len]
        at = total + frame.index * TAG_SIZE
        tag = sealed[at : at + TAG_SIZE]
        if isinstance(cipher, _SealsDetached):
            cipher.seal_detached_into(h.salt, aad, frame.index, pieces(frame), data, tag)
            return
        joined = pieces(frame)
        both = memoryview(cipher.seal_frame(h.salt, aad, frame.index, joined[0] if len(joined) == 1 else b"".join(joined)))
        if len(both) != frame.plain_len + TAG_SIZE:
            raise FormatError(f"the cipher sealed frame {frame.index} to {len(both)} bytes, not {frame.plain_len + TAG_SIZE}")
        data[: frame.plain_len] = both[: frame.plain_len]
        tag[:] = both[frame.plain_len :]

    for _ in map(seal, frames) if pool is None else pool.map(seal, frames):
        pass
    return [sealed[:total], sealed[total:]]


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
