"""Opening a part through a `PartReader` (a part held open by a store), range by range.

`open_part_from` does what `opening.open_part` does without a file image: it reads the header
first and checks it (size included) before any frame is read or a destination allocated, then
reads each frame straight into its place in the destination and verifies it there, one frame per
task on the pool, so that reads and checks of different frames overlap. Nothing is returned
before every frame verified, and after a raise the destination is zeroed. `header_key` and
`part_is_whole` read a part's header only. `BufferReader` is a `PartReader` over bytes in memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import mmap
import threading
from collections.abc import Callable, Sequence

import attrs

from galahad.domain.error import FormatError, IntegrityError, NewerFormat
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.fanout import run_frames, usable_cores
from galahad.format.opening import (
    _accepted,
    _check_size,
    _destination,
    _frames,
    _no_memory,
    _open_sealed,
)
from galahad.format.part import CipherLookup, Expect, OpenedPart
from galahad.format.v1 import (
    MAX_HEADER_LEN,
    PREAMBLE_SIZE,
    TAG_SIZE,
    BlockHeader,
    Buffer,
    Frame,
    decode_header,
    decode_key,
    tag_table_offset,
)
from galahad.ports.cipher import Cipher
from galahad.ports.store import HashedReader, PartReader, read_stepwise

__all__ = [
    "NEWER_FORMAT",
    "SMALL_SLICE",
    "BufferReader",
    "header_key",
    "open_part_from",
    "part_is_whole",
]

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
    """The cipher id and key id the part's header names (its fixed fields only: no segment
    table decoded, no frame read); None when the header does not read up to its checksum:
    whether the part is damaged is for the load, which refuses, counts and quarantines it.
    `ciphers(*header_key(r)) is None` for a part a reader would refuse as `UnknownKey`. A part of
    a newer format gives (`NEWER_FORMAT`, b""), which no cipher matches."""
    try:
        return decode_key(_read_head(reader, reader.size))
    except NewerFormat:
        return NEWER_FORMAT, b""
    except FormatError:
        return None


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


_ZEROS = bytes(1 << 20)


def _wipe(dst: memoryview) -> None:
    for start in range(0, len(dst), len(_ZEROS)):
        piece = dst[start : start + len(_ZEROS)]
        piece[:] = _ZEROS[: len(piece)]
