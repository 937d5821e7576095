"""The codec: sealing and opening parts, what a reader expects, and the keyless frame check.

The opening tests run against both ways in (the `entry` fixture): `open_part` on a whole file and
`open_part_from` on a reader of it.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest

from galahad.format.codec import (
    BufferReader,
    CipherLookup,
    Expect,
    OpenedPart,
    cipher_lookup,
    open_part,
    open_part_from,
    read_header,
    seal_part,
    sealed_len,
    verify_part,
)
from galahad.domain.error import ForeignBlock, FormatError, IntegrityError, NewerFormat, StoreUnavailable, UnknownKey
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, CipherId, DType, Segment, SegmentKind
from galahad.ports.cipher import Cipher
from galahad.ports.store import read_stepwise

CHECK = Xxh3FrameCheck()
SEGMENTS = (Segment(0, SegmentKind.KV, DType.BF16, 0, (2, 16, 8, 16)),  # 8 KiB
            Segment(0, SegmentKind.KV, DType.BF16, 1, (2, 16, 8, 16)),
            Segment(1, SegmentKind.STATE, "float32", 0, (300,)))  # 1200 B
HEADER = BlockHeader(namespace=b"N" * 32, chain_key=b"K" * 32, token_start=0, token_end=32, rank=1, world=2,
                     block_size=16, segments=SEGMENTS, frame_size=4096)
PAYLOAD = [bytes([i + 1]) * s.nbytes for i, s in enumerate(SEGMENTS)]
FLAT = attrs.evolve(HEADER, minor=0, incompat_flags=0)  # v1.0's layout: each frame followed by its tag
LAYOUTS = pytest.mark.parametrize("h", [HEADER, FLAT], ids=["aligned", "flat"])


def _blob(cipher: Cipher = CHECK, salt: bytes | None = None, h: BlockHeader = HEADER) -> bytes:
    return b"".join(seal_part(h, PAYLOAD, cipher, salt=salt))


def test_writers_write_the_aligned_layout_by_default() -> None:
    h = read_header(_blob())
    assert h.aligned and (h.minor, h.incompat_flags) == (1, 1) and h.header_len == 4096
    assert not read_header(_blob(h=FLAT)).aligned and FLAT.header_len == 160 + 3 * 56 + 16


Opener = Callable[..., OpenedPart]
ENTRIES: dict[str, Opener] = {
    "open_part": open_part,
    "open_part_from": lambda blob, **kw: open_part_from(BufferReader(blob), **kw),
}


@pytest.fixture(params=list(ENTRIES))
def entry(request: pytest.FixtureRequest) -> Opener:
    return ENTRIES[request.param]


def _opener(entry: Opener) -> Callable[..., OpenedPart]:
    def _open(blob: bytes, *, expect: Expect = Expect(), ciphers: CipherLookup = cipher_lookup(CHECK),
              pool: cf.Executor | None = None, out: memoryview | None = None) -> OpenedPart:
        return entry(blob, expect=expect, ciphers=ciphers, pool=pool, out=out)

    return _open


@pytest.mark.parametrize("field, value", [("namespace", b"n" * 32), ("chain_key", b"k" * 32), ("rank", 0),
                                          ("world", 4)])
def test_a_part_that_is_not_what_the_reader_expects_is_foreign(entry: Opener, field: str, value: object) -> None:
    with pytest.raises(ForeignBlock, match=field):
        _opener(entry)(_blob(), expect=Expect(**{field: value}))


def test_a_part_that_is_what_the_reader_expects_opens(entry: Opener) -> None:
    opened = _opener(entry)(_blob(), expect=Expect(namespace=b"N" * 32, chain_key=b"K" * 32, rank=1, world=2))
    assert bytes(opened.payload) == b"".join(PAYLOAD)


def test_a_sealed_part_without_its_key_is_an_unknown_key(entry: Opener) -> None:
    _open = _opener(entry)
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    cipher = aesgcm.AesGcmCipher(SecretKey(bytes(32)))
    blob = _blob(cipher)
    assert read_header(blob).cipher_id == CipherId.AES_256_GCM
    with pytest.raises(UnknownKey, match=cipher.key_id.hex()):
        _open(blob)
    other = aesgcm.AesGcmCipher(SecretKey(bytes(31) + b"\x01"))
    with pytest.raises(UnknownKey):
        _open(blob, ciphers=cipher_lookup(other))
    assert bytes(_open(blob, ciphers=cipher_lookup(other, cipher)).payload) == b"".join(PAYLOAD)


def test_a_reader_accepting_sealed_parts_only_refuses_checksum_parts(entry: Opener) -> None:
    with pytest.raises(UnknownKey, match="checksum-only"):
        _opener(entry)(_blob(), ciphers=lambda cipher_id, key_id: None)


def test_the_payload_is_written_into_the_callers_buffer(entry: Opener) -> None:
    out = bytearray(HEADER.payload_len + 100)
    opened = _opener(entry)(_blob(), out=memoryview(out))
    assert opened.payload.obj is out
    assert bytes(out[: HEADER.payload_len]) == b"".join(PAYLOAD)
    assert [bytes(v) for v in opened.segment_views()] == PAYLOAD


def test_a_buffer_too_small_is_a_miss_and_a_read_only_one_a_bug(entry: Opener) -> None:
    _open = _opener(entry)
    with pytest.raises(FormatError, match="more than"):
        _open(_blob(), out=memoryview(bytearray(HEADER.payload_len - 1)))
    with pytest.raises(ValueError, match="read-only"):
        _open(_blob(), out=memoryview(bytes(HEADER.payload_len)))


def test_frames_open_on_a_pool_and_a_bad_one_fails_after_all_finished(entry: Opener) -> None:
    _open = _opener(entry)
    blob = bytearray(_blob())
    with cf.ThreadPoolExecutor(3) as pool:
        assert bytes(_open(bytes(blob), pool=pool).payload) == b"".join(PAYLOAD)
        blob[-1] ^= 0x40  # the last frame's tag
        with pytest.raises(IntegrityError, match="frame 4"):
            _open(bytes(blob), pool=pool)


def test_frames_open_with_a_pool_that_was_shut_down(entry: Opener) -> None:
    pool = cf.ThreadPoolExecutor(2)
    pool.shutdown()
    assert bytes(_opener(entry)(_blob(), pool=pool).payload) == b"".join(PAYLOAD)


# -- open_part_from: what it reads, and how


class Recorder:
    """A reader of `blob` that records every read: (offset, the buffers' owners and lengths)."""

    def __init__(self, blob: bytes, *, serve: int | None = None, fail_at: int | None = None) -> None:
        self.inner, self.reads = BufferReader(blob), []  # type: ignore[var-annotated]
        self.serve, self.fail_at = serve, fail_at  # serve: bytes there really are (the size claims more)
        self.size = len(blob)

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        self.reads.append((offset, [(b.obj, len(b)) for b in buffers]))
        if self.fail_at is not None and offset >= self.fail_at:
            raise StoreUnavailable(5, "injected: the medium failed")
        if self.serve is not None:
            buffers = _clip(buffers, max(0, self.serve - offset))
        return self.inner.preadv(offset, buffers)

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int:
        return read_stepwise(self, offset, view, step, each)  # through preadv above: every read recorded


def _clip(buffers: Sequence[memoryview], room: int) -> list[memoryview]:
    out = []
    for buf in buffers:
        out.append(buf[: max(0, min(len(buf), room))])
        room -= len(buf)
    return out


def _from(reader: Any, **kw: Any) -> OpenedPart:
    return open_part_from(reader, expect=Expect(), ciphers=cipher_lookup(CHECK, *kw.pop("more", ())), **kw)


@LAYOUTS
def test_a_checksum_part_is_read_once_each_frame_straight_into_its_place(h: BlockHeader) -> None:
    out = bytearray(h.payload_len)
    reader = Recorder(_blob(h=h))
    _from(reader, out=memoryview(out))
    assert bytes(out) == b"".join(PAYLOAD)
    head, *rest = reader.reads
    assert head[0] == 0 and head[1][0][1] >= h.header_len  # the header first, in one read
    into_out = [(offset, n) for offset, buffers in rest for owner, n in buffers if owner is out]
    elsewhere = [n for _, buffers in rest for owner, n in buffers if owner is not out]
    assert sum(n for _, n in into_out) == h.payload_len  # each byte read once, into its place: no copy
    assert sum(elsewhere) == 16 * h.frame_count  # and each tag once, nothing else
    if h.aligned:  # the tag table in one read; every payload read starts on a page of the file
        assert elsewhere == [16 * h.frame_count]
        assert all(offset % 4096 == 0 for offset, _ in into_out)


def test_a_header_larger_than_the_first_read_is_read_whole() -> None:
    segments = [Segment(0, SegmentKind.KV, DType.U8, layer, (8,)) for layer in range(300)]  # 16976 bytes
    h = attrs.evolve(HEADER, segments=segments)
    blob = b"".join(seal_part(h, [bytes([i % 256]) * 8 for i in range(300)], CHECK))
    assert h.header_len > 8192
    assert bytes(_from(BufferReader(blob)).payload) == b"".join(bytes([i % 256]) * 8 for i in range(300))
    with pytest.raises(IntegrityError, match="truncated header"):
        _from(BufferReader(blob[: h.header_len - 1]))


@LAYOUTS
@pytest.mark.parametrize("kind", ["xxh3", "aes-gcm"])
@pytest.mark.parametrize("cut", [100, 8])  # the aligned layout: into the payload, into the tag table
def test_a_part_that_shrinks_while_it_is_read_is_refused_and_nothing_stays_in_out(h: BlockHeader, kind: str,
                                                                                   cut: int) -> None:
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    cipher = CHECK if kind == "xxh3" else aesgcm.AesGcmCipher(SecretKey(bytes(32)))
    blob = _blob(cipher, h=h)
    out = bytearray(b"\xee" * h.payload_len)
    with pytest.raises(IntegrityError, match="truncated: (frame|the tag table)"):
        _from(Recorder(blob, serve=len(blob) - cut), out=memoryview(out), more=[cipher])
    assert out == bytes(h.payload_len)


@LAYOUTS
@pytest.mark.parametrize("kind", ["xxh3", "aes-gcm"])
def test_a_damaged_frame_leaves_nothing_unverified_in_out(h: BlockHeader, kind: str) -> None:
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    cipher = CHECK if kind == "xxh3" else aesgcm.AesGcmCipher(SecretKey(bytes(32)))
    blob = bytearray(_blob(cipher, h=h))
    blob[h.header_len + 10] ^= 1  # frame 0's data: read into `out` before its check fails
    out = bytearray(h.payload_len)
    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(IntegrityError, match="frame 0"):
        _from(BufferReader(bytes(blob)), out=memoryview(out), pool=pool, more=[cipher])
    assert out == bytes(h.payload_len)


@LAYOUTS
@pytest.mark.parametrize("fail_at", [4096, 0])  # after the header: in the payload; with the first byte after it
def test_a_failing_medium_passes_through_as_store_unavailable(h: BlockHeader, fail_at: int) -> None:
    out = bytearray(b"\xee" * h.payload_len)
    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(StoreUnavailable, match="injected"):
        _from(Recorder(_blob(h=h), fail_at=h.header_len + fail_at), out=memoryview(out), pool=pool)
    assert out == bytes(h.payload_len)


@pytest.mark.parametrize("kind", ["xxh3", "aes-gcm"])
def test_an_aligned_part_keeps_its_tags_in_a_table_after_the_payload(kind: str) -> None:
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    cipher = CHECK if kind == "xxh3" else aesgcm.AesGcmCipher(SecretKey(bytes(32)))
    aligned, flat = _blob(cipher, salt=b"s" * 16), _blob(cipher, salt=b"s" * 16, h=FLAT)
    frames = read_header(aligned).frame_count
    assert len(aligned) - HEADER.header_len == len(flat) - FLAT.header_len == HEADER.payload_len + 16 * frames
    if kind == "xxh3":  # the payload is stored as it is, contiguous, right after the padded header
        assert aligned[HEADER.header_len : HEADER.header_len + HEADER.payload_len] == b"".join(PAYLOAD)
    assert aligned[4096 - 16 - 100 : 4096 - 16] == bytes(100)  # the header's padding


def test_sealing_takes_the_ciphers_ids_and_a_fresh_or_given_salt() -> None:
    h = read_header(_blob(salt=b"s" * 16))
    assert h == attrs.evolve(HEADER, salt=b"s" * 16)
    assert read_header(_blob()).salt != read_header(_blob()).salt


def test_checksum_sealing_stores_the_callers_buffers_without_copying() -> None:
    payload = [bytearray(p) for p in PAYLOAD]
    chunks = seal_part(HEADER, payload, CHECK)
    assert any(isinstance(c, memoryview) and c.obj is payload[0] for c in chunks)


def test_aes_gcm_seals_into_the_callers_buffer_the_same_bytes() -> None:
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    cipher = aesgcm.AesGcmCipher(SecretKey(bytes(32)))
    out = bytearray(sealed_len(HEADER) + 3)
    chunks = seal_part(HEADER, PAYLOAD, cipher, salt=b"s" * 16, out=memoryview(out))
    assert b"".join(chunks) == b"".join(seal_part(HEADER, PAYLOAD, cipher, salt=b"s" * 16))
    assert all(c.obj is out for c in chunks[1:])  # type: ignore[union-attr]
    assert sum(len(c) for c in chunks[1:]) == sealed_len(HEADER)
    with pytest.raises(FormatError, match="sealed frames"):
        seal_part(HEADER, PAYLOAD, cipher, out=memoryview(bytearray(sealed_len(HEADER) - 1)))


@pytest.mark.parametrize("payload, match", [(PAYLOAD[:2], "3 segments"),
                                            ([PAYLOAD[0], PAYLOAD[1], PAYLOAD[2][:-1]], "segment 2")])
def test_payload_buffers_must_match_the_segment_table(payload: list[bytes], match: str) -> None:
    with pytest.raises(FormatError, match=match):
        seal_part(HEADER, payload, CHECK)


def test_read_header_refuses_a_truncated_or_extended_file() -> None:
    blob = _blob()
    assert read_header(blob).payload_len == HEADER.payload_len
    with pytest.raises(IntegrityError, match="truncated"):
        read_header(blob[:-1])
    with pytest.raises(IntegrityError, match="trailing"):
        read_header(blob + b"\x00")


# -- the Cipher contract for Xxh3FrameCheck (ports/cipher.py)

SALT, AAD, DATA = b"s" * 16, b"header bytes", b"frame data " * 50


def test_checksum_opens_what_it_sealed_and_appends_a_16_byte_tag() -> None:
    sealed = CHECK.seal_frame(SALT, AAD, 3, DATA)
    assert len(sealed) == len(DATA) + 16 and sealed.startswith(DATA)
    assert CHECK.open_frame(SALT, AAD, 3, sealed) == DATA
    assert (CHECK.cipher_id, CHECK.key_id) == (0, bytes(8))


@pytest.mark.parametrize("change", ["salt", "aad", "index", "data", "tag", "short"])
def test_checksum_refuses_any_change(change: str) -> None:
    sealed = bytearray(CHECK.seal_frame(SALT, AAD, 3, DATA))
    salt, aad, index = SALT, AAD, 3
    if change == "salt":
        salt = b"t" * 16
    elif change == "aad":
        aad = AAD + b"!"
    elif change == "index":
        index = 4
    elif change == "data":
        sealed[0] ^= 1
    elif change == "tag":
        sealed[-1] ^= 1
    else:
        sealed = sealed[:15]
    with pytest.raises(IntegrityError):
        CHECK.open_frame(salt, aad, index, bytes(sealed))


def test_cipher_lookup_matches_cipher_and_key_ids() -> None:
    lookup = cipher_lookup(CHECK)
    assert lookup(0, bytes(8)) is CHECK
    assert lookup(0, b"\x01" * 8) is None and lookup(1, bytes(8)) is None


def test_a_reader_that_knows_only_v1_0_refuses_an_aligned_file_as_a_format_error(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """A reader that does not know a file's incompat flag (here: one that knows no flag, as 1.0
    did, meeting a 1.1 file) refuses it as `NewerFormat`: a miss it keeps for newer readers."""
    from galahad.format import header as v1

    blob = _blob()
    monkeypatch.setattr(v1, "KNOWN_INCOMPAT_FLAGS", 0)  # v1.0 knew no incompat flag
    with pytest.raises(FormatError, match="incompat flags 0x1") as caught:
        read_header(blob)
    assert type(caught.value) is NewerFormat  # not damaged, not foreign: a newer writer
    read_header(_blob(h=FLAT))  # a flat file is still read


# -- the verified prefix (`progress`): what a caller may copy on while the rest is read


@LAYOUTS
@pytest.mark.parametrize("threads", [0, 3])
def test_progress_reports_a_growing_verified_prefix_ending_at_the_whole_payload(h: BlockHeader, threads: int) -> None:
    seen: list[tuple[int, bytes]] = []
    out = bytearray(h.payload_len)

    def progress(n: int) -> None:
        seen.append((n, bytes(out[:n])))  # what the caller would copy on at that moment

    pool = cf.ThreadPoolExecutor(threads) if threads else None
    try:
        _from(BufferReader(_blob(h=h)), out=memoryview(out), pool=pool, progress=progress)
    finally:
        if pool is not None:
            pool.shutdown()
    whole = b"".join(PAYLOAD)
    ends = [n for n, _ in seen]
    assert ends == sorted(set(ends)) and ends[-1] == h.payload_len
    assert all(data == whole[:n] for n, data in seen)  # every byte told of was final


@pytest.mark.parametrize("bad_frame", [0, 2])
def test_progress_never_passes_a_damaged_frame(bad_frame: int) -> None:
    blob = bytearray(_blob())
    at = HEADER.header_len + bad_frame * HEADER.frame_size + 7
    blob[at] ^= 0x01
    seen: list[int] = []
    with pytest.raises(IntegrityError):
        _from(BufferReader(bytes(blob)), out=memoryview(bytearray(HEADER.payload_len)), progress=seen.append)
    assert all(n <= bad_frame * HEADER.frame_size for n in seen)
    assert (bad_frame == 0) == (not seen)


@pytest.mark.parametrize("slice_bytes", [1024, 512 << 10, 4 << 20], ids=["1KiB", "512KiB", "4MiB"])
def test_every_read_size_verifies_and_refuses_alike(slice_bytes: int) -> None:
    """The slice a frame is read in (512 KiB on few cores, a whole frame on many) changes only
    how many reads are made: the payload, and a damaged byte's refusal, are the same."""
    big = attrs.evolve(HEADER, frame_size=64 << 10)
    payload = [bytes([i + 7]) * s.nbytes for i, s in enumerate(SEGMENTS)]
    blob = bytearray(b"".join(seal_part(big, payload, CHECK)))
    assert bytes(_from(BufferReader(bytes(blob)), slice_bytes=slice_bytes).payload) == b"".join(payload)
    blob[big.header_len + 5000] ^= 0x10
    with pytest.raises(IntegrityError):
        _from(BufferReader(bytes(blob)), slice_bytes=slice_bytes)


# ---------------------------------------------------------------- sizes a header claims


def test_a_part_claiming_another_segment_table_or_more_than_the_buffer_is_a_format_error(entry: Opener) -> None:
    """Step 11's sizes (spec §6.1): refused as `FormatError` on the header, before a frame is read."""
    _open = _opener(entry)
    with pytest.raises(FormatError, match="segment table"):
        _open(_blob(), expect=Expect(segments=SEGMENTS[:2]))
    with pytest.raises(FormatError, match="at most"):
        _open(_blob(), expect=Expect(payload_max=HEADER.payload_len - 1))
    opened = _open(_blob(), expect=Expect(segments=list(SEGMENTS), payload_max=HEADER.payload_len))
    assert bytes(opened.payload) == b"".join(PAYLOAD)


def test_memory_a_header_claims_that_cannot_be_had_is_the_parts_format_error(
        entry: Opener, monkeypatch: pytest.MonkeyPatch) -> None:
    """Running out of memory for a part is that part's refusal, never a `MemoryError` (spec §6.2)."""
    import galahad.format.opening as codec

    def exhausted(h: BlockHeader) -> memoryview:
        raise MemoryError

    monkeypatch.setattr(codec, "_own_buffer", exhausted)
    with pytest.raises(FormatError, match="not enough memory"):
        _opener(entry)(_blob())


@pytest.mark.parametrize("kind", ["checksum", "sealed"])
def test_verify_part_checks_every_frame_as_open_part_does_and_keeps_nothing(kind: str) -> None:
    """`verify_part` (what `galahad-format` checks with): the header of a good part; the same
    error as `open_part` for a damaged frame, a foreign part, a key not held."""
    cipher: Cipher = CHECK
    if kind == "sealed":
        cipher = pytest.importorskip("galahad.adapters.crypto.aesgcm").AesGcmCipher(SecretKey(bytes(range(32))))
    blob = _blob(cipher)
    lookup = cipher_lookup(cipher)
    assert verify_part(blob, expect=Expect(), ciphers=lookup) == read_header(blob)
    damaged = bytearray(blob)
    damaged[HEADER.header_len + 5000] ^= 0x01  # in frame 1
    for wrong, expect, ciphers in [(bytes(damaged), Expect(), lookup), (blob, Expect(rank=0), lookup),
                                   (blob, Expect(), lambda cipher_id, key_id: None)]:
        with pytest.raises(FormatError) as by_open:
            open_part(wrong, expect=expect, ciphers=ciphers)
        with pytest.raises(FormatError) as by_verify:
            verify_part(wrong, expect=expect, ciphers=ciphers)
        assert type(by_verify.value) is type(by_open.value)


def test_a_part_of_more_frames_than_are_kept_opens_frame_by_frame_alike() -> None:
    """Past 4096 frames the frame table is worked out frame by frame, never built: the same
    bytes on a pool, and the same refusal of a damaged frame near the end."""
    many = attrs.evolve(HEADER, segments=(Segment(0, SegmentKind.KV, DType.U8, 0, (4097 * 4096 + 10,)),))
    payload = [bytes(range(256)) * (many.payload_len // 256) + bytes(many.payload_len % 256)]
    blob = bytearray(b"".join(seal_part(many, payload, CHECK)))
    with cf.ThreadPoolExecutor(2) as pool:
        opened = open_part_from(BufferReader(bytes(blob)), expect=Expect(), ciphers=cipher_lookup(CHECK), pool=pool)
        assert opened.header.frame_count == 4098 and bytes(opened.payload) == payload[0]
        blob[many.header_len + 4097 * 4096 + 3] ^= 0x01
        with pytest.raises(IntegrityError, match="frame 4097"):
            open_part_from(BufferReader(bytes(blob)), expect=Expect(), ciphers=cipher_lookup(CHECK), pool=pool)
