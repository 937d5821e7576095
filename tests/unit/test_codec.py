"""The codec: sealing and opening parts, what a reader expects, and the keyless frame check."""

from __future__ import annotations

import concurrent.futures as cf

import attrs
import pytest

from galahad.codec import CipherLookup, Expect, OpenedPart, cipher_lookup, open_part, read_header, seal_part
from galahad.domain.error import ForeignBlock, FormatError, IntegrityError, UnknownKey
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, CipherId, DType, Segment, SegmentKind
from galahad.ports.cipher import Cipher

CHECK = Xxh3FrameCheck()
SEGMENTS = (Segment(0, SegmentKind.KV, DType.BF16, 0, (2, 16, 8, 16)),  # 8 KiB
            Segment(0, SegmentKind.KV, DType.BF16, 1, (2, 16, 8, 16)),
            Segment(1, SegmentKind.STATE, "float32", 0, (300,)))  # 1200 B
HEADER = BlockHeader(namespace=b"N" * 32, chain_key=b"K" * 32, token_start=0, token_end=32, rank=1, world=2,
                     block_size=16, segments=SEGMENTS, frame_size=4096)
PAYLOAD = [bytes([i + 1]) * s.nbytes for i, s in enumerate(SEGMENTS)]


def _blob(cipher: Cipher = CHECK, salt: bytes | None = None) -> bytes:
    return b"".join(seal_part(HEADER, PAYLOAD, cipher, salt=salt))


def _open(blob: bytes, *, expect: Expect = Expect(), ciphers: CipherLookup = cipher_lookup(CHECK),
          pool: cf.Executor | None = None, out: memoryview | None = None) -> OpenedPart:
    return open_part(blob, expect=expect, ciphers=ciphers, pool=pool, out=out)


@pytest.mark.parametrize("field, value", [("namespace", b"n" * 32), ("chain_key", b"k" * 32), ("rank", 0),
                                          ("world", 4)])
def test_a_part_that_is_not_what_the_reader_expects_is_foreign(field: str, value: object) -> None:
    with pytest.raises(ForeignBlock, match=field):
        _open(_blob(), expect=Expect(**{field: value}))


def test_a_part_that_is_what_the_reader_expects_opens() -> None:
    opened = _open(_blob(), expect=Expect(namespace=b"N" * 32, chain_key=b"K" * 32, rank=1, world=2))
    assert bytes(opened.payload) == b"".join(PAYLOAD)


def test_a_sealed_part_without_its_key_is_an_unknown_key() -> None:
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


def test_a_reader_accepting_sealed_parts_only_refuses_checksum_parts() -> None:
    with pytest.raises(UnknownKey, match="checksum-only"):
        _open(_blob(), ciphers=lambda cipher_id, key_id: None)


def test_the_payload_is_written_into_the_callers_buffer() -> None:
    out = bytearray(HEADER.payload_len + 100)
    opened = _open(_blob(), out=memoryview(out))
    assert opened.payload.obj is out
    assert bytes(out[: HEADER.payload_len]) == b"".join(PAYLOAD)
    assert [bytes(v) for v in opened.segment_views()] == PAYLOAD


def test_a_buffer_too_small_is_a_miss_and_a_read_only_one_a_bug() -> None:
    with pytest.raises(FormatError, match="more than"):
        _open(_blob(), out=memoryview(bytearray(HEADER.payload_len - 1)))
    with pytest.raises(ValueError, match="read-only"):
        _open(_blob(), out=memoryview(bytes(HEADER.payload_len)))


def test_frames_open_on_a_pool_and_a_bad_one_fails_after_all_finished() -> None:
    blob = bytearray(_blob())
    with cf.ThreadPoolExecutor(3) as pool:
        assert bytes(_open(bytes(blob), pool=pool).payload) == b"".join(PAYLOAD)
        blob[-1] ^= 0x40  # the last frame's tag
        with pytest.raises(IntegrityError, match="frame 4"):
            _open(bytes(blob), pool=pool)


def test_sealing_takes_the_ciphers_ids_and_a_fresh_or_given_salt() -> None:
    h = read_header(_blob(salt=b"s" * 16))
    assert h == attrs.evolve(HEADER, salt=b"s" * 16)
    assert read_header(_blob()).salt != read_header(_blob()).salt


def test_checksum_sealing_stores_the_callers_buffers_without_copying() -> None:
    payload = [bytearray(p) for p in PAYLOAD]
    chunks = seal_part(HEADER, payload, CHECK)
    assert any(isinstance(c, memoryview) and c.obj is payload[0] for c in chunks)


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
