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
for a header that asks for it (the default), and the flat one of v1.0. Past 500 lines: the read
and write paths of both layouts, for the checksum and for ciphers, belong together.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import functools
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, overload, runtime_checkable

import attrs

from galahad.domain.error import FormatError, ForeignBlock, IntegrityError, NewerFormat, UnknownKey
from galahad.format.fanout import run_frames, usable_cores
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import (
    DEFAULT_FRAME_SIZE,
    MAX_HEADER_LEN,
    PREAMBLE_SIZE,
    TAG_SIZE,
    BlockHeader,
    Buffer,
    CipherId,
    Frame,
    Segment,
    check_expected_sizes,
    decode_header,
    encode_header,
    file_size,
    frame_at,
    frame_table,
    tag_table_offset,
)
from galahad.ports.cipher import Cipher
from galahad.ports.store import HashedReader, PartReader, read_stepwise

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "BufferReader",
    "CipherLookup",
    "Expect",
    "OpenedPart",
    "cipher_lookup",
    "header_key",
    "open_part",
    "open_part_from",
    "read_header",
    "seal_part",
    "sealed_len",
    "verify_part",
]

CipherLookup = Callable[[int, bytes], Cipher | None]
"""Given a header's cipher id and key id, the cipher to open it with, or None (not accepted)."""


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


# ---------------------------------------------------------------- writing


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


# ---------------------------------------------------------------- reading


def read_header(blob: Buffer) -> BlockHeader:
    """The header of a whole file, checked (checksum, rules, exact file size) but no frame opened."""
    view = memoryview(blob).cast("B")
    h = decode_header(view)
    _check_size(h, len(view))
    return h


NEWER_FORMAT = -1  # `header_key`'s cipher id for a part of a newer format (no cipher has it)


def part_is_whole(reader: PartReader) -> bool:
    """Whether the part `reader` holds has a header that reads and exactly the size that header
    gives (no frame opened): False for a file cut short, grown, or not a Galahad block at all.
    What a save asks of a part of another size than its own found at its name."""
    try:
        size = reader.size
        _check_size(decode_header(_read_head(reader, size)), size)
    except NewerFormat:  # a newer writer's part: whole to it, and left alone
        return True
    except FormatError:
        return False
    return True


def header_key(reader: PartReader) -> tuple[int, bytes] | None:
    """The cipher id and key id the part's header names (no frame read); None when the header
    does not read: whether the part is damaged is for the load, which refuses, counts and
    quarantines it. `ciphers(*header_key(r)) is None` for a part a reader would refuse as
    `UnknownKey`. A part of a newer format gives (`NEWER_FORMAT`, b""), which no cipher matches."""
    try:
        h = decode_header(_read_head(reader, reader.size))
    except NewerFormat:
        return NEWER_FORMAT, b""
    except FormatError:
        return None
    return int(h.cipher_id), bytes(h.key_id)


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


def open_part_from(
    reader: PartReader,
    *,
    expect: Expect,
    ciphers: CipherLookup,
    pool: cf.Executor | None = None,
    out: memoryview | None = None,
    progress: Callable[[int], None] | None = None,
    slice_bytes: int | None = None,
) -> OpenedPart:
    """`open_part` of the part `reader` holds open, reading it range by range (no file image).

    The header is read first and checked like `open_part` checks it (size included), before any
    frame is read or a destination allocated. Then each frame is a task, on `pool` when given
    (the calling thread takes frames too): read its bytes straight into its place in the
    destination and its tag into a small buffer (checksum), or into a per-thread buffer and open
    them into the destination (AES-GCM), and verify. The same errors as `open_part` for the same
    bytes, and a `StoreUnavailable` from the reader passes through. After a raise, the
    destination is zeroed: unverified bytes never stay behind.

    `progress(n)`, when given, is called each time the verified prefix of the destination grows,
    with its length in bytes (from the thread that verified the frame completing it, one call at
    a time, `n` increasing): the first `n` bytes are final, so a caller can start copying them on
    while the rest is still read. A raise later does not undo what it was told.

    `slice_bytes`: how much of a checksum frame one read brings in before it is hashed (default:
    chosen for this machine's cores, `_slice_bytes`).
    """
    head, h, cipher = _checked_head(reader, expect, ciphers)
    try:
        dst = _destination(h, out)
    except MemoryError as exc:
        raise _no_memory(h) from exc
    try:
        work = _frame_opener(reader, h, bytes(head[: h.header_len]), cipher, dst, _read_tags(reader, h),
                             slice_bytes or _slice_bytes())
        frames = _frames(h)
        if progress is not None:
            work = _VerifiedPrefix(frames, progress).wrap(work)
        run_frames(work, frames, pool)
    except BaseException as exc:
        if out is not None:  # a buffer of its own is dropped unread: wiping it would only fill its pages
            _wipe(dst)
        if isinstance(exc, MemoryError):
            raise _no_memory(h) from exc
        raise
    return OpenedPart(h, dst)


class _VerifiedPrefix:
    """Tells `progress` how far the destination is verified without a gap, as frames finish (in
    any order, on any thread)."""

    def __init__(self, frames: Sequence[Frame], progress: Callable[[int], None]) -> None:
        self._ends = [f.plain_offset + f.plain_len for f in frames]
        self._position = {f.index: i for i, f in enumerate(frames)}
        self._done = [False] * len(frames)
        self._next = 0
        self._lock = threading.Lock()
        self._progress = progress

    def wrap(self, work: Callable[[Frame], None]) -> Callable[[Frame], None]:
        def run(frame: Frame) -> None:
            work(frame)  # raises before marking: a frame that failed never counts as verified
            self._mark(self._position[frame.index])

        return run

    def _mark(self, i: int) -> None:
        with self._lock:  # the calls stay in order, each prefix longer than the last
            self._done[i] = True
            start = self._next
            while self._next < len(self._done) and self._done[self._next]:
                self._next += 1
            if self._next > start:
                self._progress(self._ends[self._next - 1])


class BufferReader:
    """A `PartReader` over a file's bytes in memory (tests and tools; stores have their own)."""

    def __init__(self, blob: Buffer) -> None:
        self._view = memoryview(blob).cast("B")

    @property
    def size(self) -> int:
        return len(self._view)

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        if offset < 0:
            raise ValueError(f"a read offset is non-negative, got {offset}")
        done = 0
        for buf in buffers:
            piece = self._view[offset + done : offset + done + len(buf)]
            buf[: len(piece)] = piece
            done += len(piece)
            if len(piece) < len(buf):
                break
        return done

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int:
        return read_stepwise(self, offset, view, step, each)

    def close(self) -> None:
        pass

    def __enter__(self) -> BufferReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


SMALL_SLICE = 512 << 10  # checksum frames read and hashed this much at a time: it is still in L2
_SLICE_MANY_CORES = 4 << 20  # with 8 or more usable cores: a frame per read (see `_slice_bytes`)


@functools.cache
def _slice_bytes() -> int:
    """How much of a checksum frame one read brings in before it is hashed, in this process.

    512 KiB where the cores are few: the slice is hashed while still in L2. With 8 or more cores
    many loads run at once and each read is a round trip through the interpreter lock; a whole
    4 MiB frame per read makes 8 times fewer of them. A process that reads one part at a time
    with nobody to share the lock with (a reader process) asks for `SMALL_SLICE` itself."""
    return SMALL_SLICE if usable_cores() < 8 else _SLICE_MANY_CORES
_HEAD_PROBE = 4 << 10  # the first read: the whole header of an aligned part of up to 70 segments (one page)
_SCRATCH_KEPT = 64 << 20  # a thread keeps a frame buffer up to this size between parts
_ALIGN = 64  # cache line: the kernel copies fastest when source and destination agree modulo it
_scratch = threading.local()
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


def _checked_head(reader: PartReader, expect: Expect, ciphers: CipherLookup) -> tuple[memoryview, BlockHeader, Cipher]:
    """The part's first bytes, its header decoded and checked (size included) against what the
    reader expects, and the cipher to open its frames with: before any frame is read."""
    size = reader.size
    head = _read_head(reader, size)
    h = decode_header(head)
    _check_size(h, size)
    return head, h, _accepted(h, expect, ciphers)


def _read_head(reader: PartReader, size: int) -> memoryview:
    """The file's first bytes, enough for `decode_header` to see what it would in the whole file."""
    head = memoryview(bytearray(min(size, _HEAD_PROBE)))
    head = head[: reader.preadv(0, [head])]
    if len(head) >= PREAMBLE_SIZE:
        want = min(size, int.from_bytes(head[PREAMBLE_SIZE - 4 : PREAMBLE_SIZE], "little"))
        if len(head) < want <= MAX_HEADER_LEN:  # a larger claim is refused by decode_header
            head = memoryview(bytearray(want))
            head = head[: reader.preadv(0, [head])]
    return head


def _accepted(h: BlockHeader, expect: Expect, ciphers: CipherLookup) -> Cipher:
    """The cipher to open `h`'s frames with, once `h` is what the reader expects."""
    expect.check(h)
    cipher = ciphers(h.cipher_id, h.key_id)
    if cipher is None:
        if h.cipher_id == CipherId.XXH3:
            raise UnknownKey("a checksum-only file (cipher 0), and this reader accepts sealed files only")
        raise UnknownKey(f"sealed under key id {h.key_id.hex()}, which this reader does not hold")
    return cipher


def _read_tags(reader: PartReader, h: BlockHeader) -> memoryview | None:
    """The aligned layout's tag table, in one read (the file's size was checked: it is there);
    None in the flat layout, where each frame's tag is read with the frame."""
    at = tag_table_offset(h)
    if at is None:
        return None
    tags = memoryview(bytearray(TAG_SIZE * h.frame_count))
    got = reader.preadv(at, [tags])
    if got != len(tags):
        raise IntegrityError(f"truncated: the tag table read {got} of its {len(tags)} bytes")
    return tags


def _frame_opener(
    reader: PartReader, h: BlockHeader, aad: bytes, cipher: Cipher, dst: memoryview, tags: memoryview | None,
    slice_bytes: int,
) -> Callable[[Frame], None]:
    """The task that reads, verifies and places one frame; which one is decided once per part.

    Aligned layout (`tags` given): a frame's bytes sit in the file in the same order, and at the
    same offset modulo 4096, as in the destination, so they are read straight into their place.
    """
    opener = _FrameOpener(reader, h, aad, cipher, dst, tags, slice_bytes)
    if isinstance(cipher, Xxh3FrameCheck):  # verified in place: the destination is the only copy
        if isinstance(reader, HashedReader):  # a frame read and hashed in one call
            return functools.partial(opener.check_hashed, reader, cipher)
        return functools.partial(opener.check, cipher)
    # A cipher reads from a scratch buffer: reading the ciphertext into the destination and
    # decrypting it there in place costs more CPU (the kernel's copy is no longer aligned).
    return opener.open_from_scratch


@attrs.frozen
class _FrameOpener:
    """The ways to read and verify one frame of one part (see `_frame_opener`)."""

    reader: PartReader
    h: BlockHeader
    aad: bytes
    cipher: Cipher
    dst: memoryview
    tags: memoryview | None
    slice_bytes: int

    def _target(self, frame: Frame) -> memoryview:
        return self.dst[frame.plain_offset : frame.plain_offset + frame.plain_len]

    def _tag(self, frame: Frame) -> memoryview:
        """The aligned layout's tag of `frame`, from the table read before the frames."""
        table = memoryview(b"") if self.tags is None else self.tags
        return table[frame.index * TAG_SIZE : (frame.index + 1) * TAG_SIZE]

    @staticmethod
    def _cut_short(frame: Frame, got: int) -> IntegrityError:
        return IntegrityError(f"truncated: frame {frame.index} read {got} of its {frame.plain_len + TAG_SIZE} bytes")

    def check(self, cipher: Xxh3FrameCheck, frame: Frame) -> None:
        """Checksum: read into the destination a slice at a time, each hashed while in cache."""
        state = cipher.hasher(self.h.salt, self.aad, frame.index)
        target = self._target(frame)
        got = self.reader.read_stepwise(frame.data_offset, target, self.slice_bytes, state.update)
        cipher.check_digest(frame.index, state, self._tag_after(frame, got, len(target)))

    def check_hashed(self, reader: HashedReader, cipher: Xxh3FrameCheck, frame: Frame) -> None:
        """`check` through the reader's one-call read and hash (`HashedReader`); `check` itself
        where the reader cannot take this read."""
        target = self._target(frame)
        done = reader.read_hashed(frame.data_offset, target, cipher.seed(self.h.salt, self.aad, frame.index))
        if done is None:
            self.check(cipher, frame)
            return
        got, digest = done
        cipher.check_tag(frame.index, digest, self._tag_after(frame, got, len(target)))

    def _tag_after(self, frame: Frame, got: int, size: int) -> memoryview:
        """The tag of a checksum frame whose first `got` of `size` bytes were read: read after
        them in the flat layout, from the table in the aligned one; the frame's `IntegrityError`
        when it was cut short."""
        if self.tags is None:  # flat: the tag follows the bytes
            tag = memoryview(bytearray(TAG_SIZE))
            got += self.reader.preadv(frame.data_offset + got, [tag]) if got == size else 0
        else:
            tag = self._tag(frame)
            got += TAG_SIZE if got == size else 0
        if got != size + TAG_SIZE:
            raise self._cut_short(frame, got)
        return tag

    def open_from_scratch(self, frame: Frame) -> None:
        """Any other cipher: the sealed frame read into a per-thread buffer, opened from there."""
        sealed = _frame_scratch(frame)
        if self.tags is None:
            got = self.reader.preadv(frame.data_offset, [sealed])
        else:
            got = self.reader.preadv(frame.data_offset, [sealed[: frame.plain_len]])
            sealed[frame.plain_len :] = self._tag(frame)
            got += TAG_SIZE if got == frame.plain_len else 0
        if got != frame.plain_len + TAG_SIZE:
            raise self._cut_short(frame, got)
        _open_sealed(self.cipher, self.h, self.aad, frame, sealed, self._target(frame))


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


def _frame_scratch(frame: Frame) -> memoryview:
    """This thread's buffer for one sealed frame, placed so that it agrees with the frame's file
    offset modulo a cache line (the kernel's copy into it then runs at full speed)."""
    sealed = frame.plain_len + TAG_SIZE
    need = sealed + _ALIGN
    buf: memoryview | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < need:
        buf = memoryview(mmap.mmap(-1, need))  # page-aligned
        if need <= _SCRATCH_KEPT:
            _scratch.buf = buf
    skew = frame.data_offset % _ALIGN
    return buf[skew : skew + sealed]


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


def _writable_bytes(out: memoryview, need: int, what: str) -> memoryview:
    dst = out.cast("B")
    if dst.readonly:
        raise ValueError("the output buffer is read-only")
    if len(dst) < need:
        raise FormatError(f"the {what} is {need} bytes, more than the {len(dst)}-byte buffer")
    return dst[:need]


_ZEROS = bytes(1 << 20)


def _wipe(dst: memoryview) -> None:
    for start in range(0, len(dst), len(_ZEROS)):
        piece = dst[start : start + len(_ZEROS)]
        piece[:] = _ZEROS[: len(piece)]
