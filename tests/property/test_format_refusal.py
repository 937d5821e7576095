"""Format v1 refuses what it must: arbitrary bytes, every bit flip, every truncation, absurd sizes.

Whatever the bytes, `open_part` ends with the payload or a `FormatError` (or a subclass): never
another exception, never a hang, never an allocation sized by an unchecked length. Every test
runs against each way in: `open_part` on the whole file, and `open_part_from` reading it range by
range (in the calling thread, and with frames on a pool), which must refuse exactly the same.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import time
import tracemalloc
from collections.abc import Callable

import pytest
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

from galahad.format.codec import (
    NEWER_FORMAT, BufferReader, Expect, OpenedPart, cipher_lookup, header_key, open_part, open_part_from, seal_part,
    verify_part,
)
from galahad.domain.error import FormatError, IntegrityError, NewerFormat
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import MAGIC, BlockHeader, DType, Segment, SegmentKind, decode_header, encode_header

aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")

CHECK = Xxh3FrameCheck()
AES = aesgcm.AesGcmCipher(SecretKey(bytes(range(32))))
READER = cipher_lookup(CHECK, AES)
SLOW_CALL_S = 0.5  # one refusal of a small input takes well under a millisecond


def _header(**over: object) -> BlockHeader:
    fields: dict[str, object] = dict(
        namespace=b"N" * 32, chain_key=b"K" * 32, token_start=0, token_end=32, rank=1, world=2, block_size=16,
        segments=[Segment(0, SegmentKind.KV, DType.BF16, 0, (2, 4, 8)), Segment(1, SegmentKind.STATE, DType.F32, 3, (43,))],
        frame_size=4096,
    )
    fields.update(over)
    return BlockHeader(**fields)  # type: ignore[arg-type]


def _file(h: BlockHeader, cipher: object) -> bytes:
    payload = [bytes((i * 7 + 1) % 256 for i in range(s.nbytes)) for s in h.segments]
    return b"".join(seal_part(h, payload, cipher, salt=b"S" * 16))  # type: ignore[arg-type]


FLAT = dict(minor=0, incompat_flags=0)  # v1.0's layout, still read
PLAIN = _file(_header(), CHECK)  # aligned: 4096-byte header, 300-byte payload, one tag: 4412 bytes
SEALED = _file(_header(), AES)
MULTI = _file(_header(segments=[Segment(0, SegmentKind.KV, DType.U8, 0, (4096 + 100,))]), CHECK)
PLAIN_FLAT = _file(_header(**FLAT), CHECK)  # 288-byte header, 300-byte payload, one frame: 604 bytes
SEALED_FLAT = _file(_header(**FLAT), AES)
MULTI_FLAT = _file(_header(segments=[Segment(0, SegmentKind.KV, DType.U8, 0, (4096 + 100,))], **FLAT), CHECK)
ONE_FRAME = {"xxh3": PLAIN, "aes-gcm": SEALED, "xxh3-flat": PLAIN_FLAT, "aes-gcm-flat": SEALED_FLAT}
ALL = {**ONE_FRAME, "two-frames": MULTI, "two-frames-flat": MULTI_FLAT}
one_frame = pytest.mark.parametrize("blob", list(ONE_FRAME.values()), ids=list(ONE_FRAME))
every_blob = pytest.mark.parametrize("blob", list(ALL.values()), ids=list(ALL))


POOL = cf.ThreadPoolExecutor(2)
Entry = Callable[[bytes], OpenedPart]
ENTRIES: dict[str, Entry] = {
    "open_part": lambda blob: open_part(blob, expect=Expect(), ciphers=READER),
    "open_part_from": lambda blob: open_part_from(BufferReader(blob), expect=Expect(), ciphers=READER),
    "open_part_from_pool": lambda blob: open_part_from(BufferReader(blob), expect=Expect(), ciphers=READER,
                                                       pool=POOL),
}
entries = pytest.mark.parametrize("entry", list(ENTRIES.values()), ids=list(ENTRIES))
# `galahad-format`'s check: frame by frame, keeping nothing (its payload is empty); refuses alike
VERIFY: Entry = lambda blob: OpenedPart(verify_part(blob, expect=Expect(), ciphers=READER), memoryview(b""))  # noqa: E731
refusing = pytest.mark.parametrize("entry", [*ENTRIES.values(), VERIFY], ids=[*ENTRIES, "verify_part"])


def _refused(blob: bytes, entry: Entry = ENTRIES["open_part"]) -> FormatError:
    collecting = gc.isenabled()
    gc.disable()  # a full collection of the test run's garbage (0.3 s and more here) is not the call's time
    try:
        t0 = time.perf_counter()
        with pytest.raises(FormatError) as caught:
            entry(blob)
        elapsed = time.perf_counter() - t0
    finally:
        if collecting:
            gc.enable()
    assert elapsed < SLOW_CALL_S
    return caught.value


@refusing
@given(st.binary(max_size=4096))
@example(b"")
@example(MAGIC)
@example(MAGIC + b"\x01\x00" + bytes(14))
def test_arbitrary_bytes_raise_only_format_errors(entry: Entry, data: bytes) -> None:
    _refused(data, entry)


@refusing
@given(st.binary(max_size=2048), st.integers(0, 2**32 - 1))
def test_arbitrary_bytes_after_a_valid_preamble_raise_only_format_errors(entry: Entry, rest: bytes,
                                                                         header_len: int) -> None:
    _refused(MAGIC + b"\x01\x00\x00\x00" + bytes(8) + header_len.to_bytes(4, "little") + rest, entry)


@refusing
@given(st.sampled_from(list(ALL.values())), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                         min_size=1, max_size=8))
def test_any_overwrite_of_a_valid_file_is_refused(entry: Entry, blob: bytes, edits: list[tuple[int, int]]) -> None:
    data = bytearray(blob)
    for position, value in edits:
        data[position % len(data)] = value
    if bytes(data) != blob:
        _refused(bytes(data), entry)


@entries
@given(st.sampled_from(list(ALL.values())), st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_refused(entry: Entry, blob: bytes, tail: bytes) -> None:
    assert isinstance(_refused(blob + tail, entry), IntegrityError)


@entries
@one_frame
def test_every_single_bit_flip_is_refused(entry: Entry, blob: bytes) -> None:
    assert bytes(entry(blob).payload) == bytes(open_part(blob, expect=Expect(), ciphers=READER).payload)
    data = bytearray(blob)
    for bit in range(len(blob) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        _refused(bytes(data), entry)
        data[bit // 8] ^= 1 << (bit % 8)


@entries
@every_blob
def test_every_truncation_is_refused(entry: Entry, blob: bytes) -> None:
    for size in range(len(blob)):
        assert isinstance(_refused(blob[:size], entry), IntegrityError)  # a cut file is damaged, not foreign


def _error(blob: bytes, entry: Entry) -> FormatError:
    with pytest.raises(FormatError) as caught:
        entry(blob)
    return caught.value


@pytest.mark.parametrize("entry", [ENTRIES["open_part_from"], ENTRIES["open_part_from_pool"], VERIFY],
                         ids=["open_part_from", "open_part_from_pool", "verify_part"])
@every_blob
def test_both_ways_in_refuse_a_bit_flip_or_a_cut_with_the_same_error(entry: Entry, blob: bytes) -> None:
    """Not just refused: refused for the same reason, in the same words (every third bit, every cut)."""
    data = bytearray(blob)
    for bit in range(0, len(blob) * 8, 3):
        data[bit // 8] ^= 1 << (bit % 8)
        whole, ranged = _error(bytes(data), ENTRIES["open_part"]), _error(bytes(data), entry)
        assert (type(ranged), str(ranged)) == (type(whole), str(whole)), bit
        data[bit // 8] ^= 1 << (bit % 8)
    for size in range(len(blob)):
        whole, ranged = _error(blob[:size], ENTRIES["open_part"]), _error(blob[:size], entry)
        assert (type(ranged), str(ranged)) == (type(whole), str(whole)), size


@pytest.mark.slow
@entries
@pytest.mark.parametrize("blob", [MULTI, MULTI_FLAT], ids=["aligned", "flat"])
def test_every_single_bit_flip_of_a_two_frame_file_is_refused(entry: Entry, blob: bytes) -> None:
    data = bytearray(blob)
    for bit in range(len(blob) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        _refused(bytes(data), entry)
        data[bit // 8] ^= 1 << (bit % 8)


@refusing
def test_a_header_claiming_a_terabyte_is_refused_without_allocating_it(entry: Entry) -> None:
    h = _header(segments=[Segment(0, SegmentKind.KV, DType.U8, 0, (1 << 40,))])
    head = encode_header(h)
    tracemalloc.start()
    try:
        error = _refused(head + bytes(100), entry)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(error, IntegrityError) and "truncated" in str(error)
    assert peak < 1 << 20


@entries
def test_an_absurd_segment_count_is_refused_before_the_table_is_read(entry: Entry) -> None:
    head = bytearray(encode_header(_header()))
    head[148:152] = (2**32 - 1).to_bytes(4, "little")  # segment_count
    head[-16:] = xxhash.xxh3_128_digest(bytes(head[:-16]))  # a valid checksum: only the count is wrong
    tracemalloc.start()
    try:
        error = _refused(bytes(head) + PLAIN[len(head):], entry)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "segments exceed" in str(error)
    assert peak < 1 << 20


@pytest.mark.parametrize(("field", "value", "says"), [
    ("rank", 2, "not below world size"),
    ("token_end", 0, "is empty"),
    ("block_size", 0, "block size"),
    ("cipher_id", 9, "unknown cipher id"),
    ("key_id", b"k" * 8, "all-zero key id"),
    ("frame_size", 4096 + 1, "not a power of two"),
])
def test_a_header_whose_checksum_holds_but_breaks_a_rule_is_refused(field: str, value: object, says: str) -> None:
    """The rules hold on the way in as well as out: a decoded header is built through its attrs
    class, so every rule of the format runs on it."""
    from galahad.format import header as v1

    head = bytearray(encode_header(_header()))
    fixed = v1._FIXED.parse(bytes(head[: v1.FIXED_SIZE]))
    fixed[field] = value
    head[: v1.FIXED_SIZE] = v1._FIXED.build(fixed)
    head[-16:] = xxhash.xxh3_128_digest(bytes(head[:-16]))  # a valid checksum: only the rule is broken
    with pytest.raises(FormatError, match=says):
        v1.decode_header(bytes(head))


def _decoded_key(data: bytes) -> tuple[int, bytes] | None:
    try:
        h = decode_header(data)
    except NewerFormat:
        return NEWER_FORMAT, b""
    except FormatError:
        return None
    return int(h.cipher_id), bytes(h.key_id)


@given(st.sampled_from(list(ALL.values())), st.lists(st.tuples(st.integers(0, 8191), st.integers(0, 255)),
                                                         max_size=4), st.integers(0, 8192))
def test_header_key_names_what_the_whole_header_decodes_to(blob: bytes, edits: list[tuple[int, int]],
                                                           cut: int) -> None:
    """`header_key` (what a lookup asks of every entry it offers) reads the fixed fields only: on
    every damaged, cut or intact header it names the cipher and key `decode_header` finds, or none
    where the header does not read up to its checksum; it never raises."""
    data = bytearray(blob[: max(cut, 1)] if cut < len(blob) else blob)
    for position, value in edits:
        data[position % len(data)] = value
    named, decoded = header_key(BufferReader(bytes(data))), _decoded_key(bytes(data))
    if decoded is not None or named is None:
        assert named == decoded
    else:  # named, refused by a rule past the checksum (the table's): the checksum holds
        n = int.from_bytes(data[20:24], "little")
        assert len(data) >= n and xxhash.xxh3_128_digest(bytes(data[: n - 16])) == data[n - 16 : n]
    if bytes(data) in (SEALED, SEALED_FLAT):
        assert named == (1, AES.key_id)
