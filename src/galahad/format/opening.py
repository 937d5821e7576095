"""Opening a part held whole in memory: its header checked, then every frame verified.

`read_header` checks a whole file's header (checksum, rules, exact file size) and opens no frame.
`open_part` checks a whole file in memory (header, size, what the reader expects, every frame)
and returns the verified payload, one frame per task on the pool; `verify_part` checks it the
same way and keeps nothing, in memory bounded by one frame. Nothing is returned before every
frame verified. The steps a part read range by range shares with them (the cipher a reader
accepts, opening a sealed frame, the buffer a payload lands in) are here too; `reading` holds
the rest of that path.

A header's sizes are not authenticated before its frames verified: they are compared with what
the reader expects (`Expect`: the segment table, the buffer it reads into) before anything is
allocated or iterated by them, and memory the kernel cannot give for a claim is the part's
`FormatError`, never a `MemoryError` (spec §6.1, §6.2).
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
from collections.abc import Sequence
from typing import Protocol, overload, runtime_checkable

from galahad.domain.error import FormatError, IntegrityError, UnknownKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.fanout import run_frames
from galahad.format.part import CipherLookup, Expect, OpenedPart, _writable_bytes
from galahad.format.v1 import TAG_SIZE, BlockHeader, Buffer, CipherId, Frame, decode_header, file_size, frame_at, frame_table
from galahad.ports.cipher import Cipher

__all__ = [
    "open_part",
    "read_header",
    "verify_part",
]


@runtime_checkable
class _OpensDetached(Protocol):
    """A cipher that opens a frame whose ciphertext and tag lie apart (an aligned file in memory)
    into `out`, without joining them first."""

    def open_detached_into(
        self, salt: bytes, aad: bytes, index: int, data: Buffer, tag: Buffer, out: memoryview
    ) -> int: ...


@runtime_checkable
class _OpensInto(Protocol):
    """A cipher that can open a frame into a caller's buffer (saves a copy per frame)."""

    def open_frame_into(self, salt: bytes, aad: bytes, index: int, sealed: Buffer, out: memoryview) -> int: ...


def read_header(blob: Buffer) -> BlockHeader:
    """The header of a whole file, checked (checksum, rules, exact file size) but no frame opened."""
    view = memoryview(blob).cast("B")
    h = decode_header(view)
    _check_size(h, len(view))
    return h


def _check_size(h: BlockHeader, size: int) -> None:
    want = file_size(h)
    if size < want:
        raise IntegrityError(f"truncated: the file is {size} bytes, its header says {want}")
    if size > want:
        raise IntegrityError(f"trailing bytes: the file is {size} bytes, its header says {want}")


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
    cipher = _accepted(h, expect, ciphers)
    aad = bytes(view[: h.header_len])
    try:
        dst = _destination(h, out)

        def open_frame(frame: Frame) -> None:
            target = dst[frame.plain_offset : frame.plain_offset + frame.plain_len]
            _open_in_memory(cipher, h, aad, view, frame, target)

        run_frames(open_frame, _frames(h), pool)
    except MemoryError as exc:
        raise _no_memory(h) from exc
    return OpenedPart(h, dst)


def verify_part(blob: Buffer, *, expect: Expect, ciphers: CipherLookup) -> BlockHeader:
    """Verify a whole file as `open_part` does, keeping none of its payload; its header once
    every frame verified.

    The frames are checked one after the other as the frame table is walked (never built): a
    checksum frame where it lies, a sealed one opened into a single buffer of one frame. So the
    memory a check takes is bounded by one frame (256 MiB at most, spec §9) whatever the header
    claims, and a first bad frame ends it: what a tool checking files it will not use needs
    (`galahad-format`). The same errors as `open_part` for the same bytes."""
    view = memoryview(blob).cast("B")
    h = read_header(view)
    cipher = _accepted(h, expect, ciphers)
    aad = bytes(view[: h.header_len])
    try:
        scratch = None if isinstance(cipher, Xxh3FrameCheck) else memoryview(bytearray(min(h.frame_size, h.payload_len)))
        for frame in frame_table(h):
            _open_in_memory(cipher, h, aad, view, frame, None if scratch is None else scratch[: frame.plain_len])
    except MemoryError as exc:
        raise _no_memory(h) from exc
    return h


def _open_in_memory(cipher: Cipher, h: BlockHeader, aad: bytes, view: memoryview, frame: Frame,
                    target: memoryview | None) -> None:
    """Verify frame `frame` of the whole file `view` and put its plaintext in `target`; None (a
    checksum only): verify it where it lies, copy nothing."""
    data = view[frame.data_offset : frame.data_offset + frame.plain_len]
    tag = view[frame.tag_offset : frame.tag_offset + TAG_SIZE]
    if isinstance(cipher, Xxh3FrameCheck):  # verified where it lies, then one copy
        state = cipher.hasher(h.salt, aad, frame.index)
        state.update(data)
        cipher.check_digest(frame.index, state, tag)
        if target is not None:
            target[:] = data
        return
    if target is None:
        raise ValueError(f"cipher {h.cipher_id} needs a buffer to open frame {frame.index} into")
    if isinstance(cipher, _OpensDetached):  # straight into the target: no copy beyond the cipher's own
        _check_opened(frame, cipher.open_detached_into(h.salt, aad, frame.index, data, tag, target))
    else:  # a cipher that wants C_i || T_i in one piece: as stored (flat) or joined (aligned)
        sealed = view[frame.data_offset : frame.tag_offset + TAG_SIZE] if not h.aligned else bytes(data) + bytes(tag)
        _open_sealed(cipher, h, aad, frame, sealed, target)


def _accepted(h: BlockHeader, expect: Expect, ciphers: CipherLookup) -> Cipher:
    """The cipher to open `h`'s frames with, once `h` is what the reader expects."""
    expect.check(h)
    cipher = ciphers(h.cipher_id, h.key_id)
    if cipher is None:
        if h.cipher_id == CipherId.XXH3:
            raise UnknownKey("a checksum-only file (cipher 0), and this reader accepts sealed files only")
        raise UnknownKey(f"sealed under key id {h.key_id.hex()}, which this reader does not hold")
    return cipher


def _open_sealed(
    cipher: Cipher, h: BlockHeader, aad: bytes, frame: Frame, sealed: bytes | memoryview, target: memoryview
) -> None:
    """Open a sealed frame (`C_i || T_i` together) into `target`, into it directly where the
    cipher can, and check its length."""
    if isinstance(cipher, _OpensInto):  # no copy beyond the cipher's own
        size = cipher.open_frame_into(h.salt, aad, frame.index, sealed, target)
    else:
        plain = cipher.open_frame(h.salt, aad, frame.index, sealed)
        size = len(plain)
        if size == frame.plain_len:
            target[:] = plain
    _check_opened(frame, size)


def _check_opened(frame: Frame, size: int) -> None:
    if size != frame.plain_len:
        raise IntegrityError(f"frame {frame.index} opened to {size} bytes, expected {frame.plain_len}")


_FRAME_TABLES_KEPT = 16  # part shapes whose frame tables are kept: a model's parts come in a few
_FRAMES_KEPT = 4096  # frames in a kept table (16 GiB of 4 MiB frames)
_frame_tables: dict[tuple[int, int, int, bool], tuple[Frame, ...]] = {}


def _frames(h: BlockHeader) -> Sequence[Frame]:
    """`frame_table(h)` as a sequence: the same one for every part of the same shape (kept for
    up to `_FRAME_TABLES_KEPT` shapes of up to `_FRAMES_KEPT` frames); beyond that many frames,
    each worked out when asked for (nothing sized by the frame count is built)."""
    if h.frame_count > _FRAMES_KEPT:
        return _FrameSequence(h)
    shape = (h.frame_size, h.payload_len, h.header_len, h.aligned)
    frames = _frame_tables.get(shape)
    if frames is None:
        frames = tuple(frame_table(h))
        if len(_frame_tables) >= _FRAME_TABLES_KEPT:
            _frame_tables.clear()
        _frame_tables[shape] = frames
    return frames


class _FrameSequence(Sequence[Frame]):
    """The frames of a part, each worked out when asked for (`frame_at`): O(1) memory."""

    def __init__(self, h: BlockHeader) -> None:
        self._h = h
        self._count = h.frame_count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Frame: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Frame]: ...

    def __getitem__(self, index: int | slice) -> Frame | Sequence[Frame]:
        if isinstance(index, slice):
            return [frame_at(self._h, i) for i in range(*index.indices(self._count))]
        return frame_at(self._h, index + self._count if index < 0 else index)


def _destination(h: BlockHeader, out: memoryview | None) -> memoryview:
    if out is None:
        return _own_buffer(h)
    return _writable_bytes(out, h.payload_len, "payload")


_LAZY_FROM = 1 << 20  # a payload buffer of its own this large or larger is mapped, not a bytearray


def _own_buffer(h: BlockHeader) -> memoryview:
    """A new buffer for `h`'s payload. From `_LAZY_FROM` bytes, private anonymous memory: the
    kernel gives it pages as frames are written into it, so a part whose header claims more than
    it holds costs what was read before its first bad frame, not its claim (a `bytearray` is
    zeroed first, every page of it). A claim the kernel will not map at all (more than the
    machine has) is the part's `FormatError`."""
    n = h.payload_len
    if n < _LAZY_FROM:
        return memoryview(bytearray(n))
    try:
        return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE))
    except OSError as exc:
        raise _no_memory(h) from exc


def _no_memory(h: BlockHeader) -> FormatError:
    """A part whose payload (as its header claims it) cannot be had in memory: the part's fault,
    refused as any header that breaks a rule is (spec §6.2: never another exception)."""
    return FormatError(f"not enough memory for the {h.payload_len}-byte payload in {h.frame_count} frame(s) "
                       "that the header claims")
