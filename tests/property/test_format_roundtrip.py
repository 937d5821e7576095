"""Round trips of format v1 in both directions, for generated headers and blocks."""

from __future__ import annotations

import concurrent.futures as cf
import math

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from galahad.format.codec import BufferReader, Expect, cipher_lookup, open_part, open_part_from, read_header, seal_part
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import (
    INCOMPAT_ALIGNED,
    MAX_FRAME_SIZE,
    MAX_PAYLOAD_LEN,
    MIN_FRAME_SIZE,
    BlockHeader,
    CipherId,
    DType,
    Segment,
    SegmentKind,
    decode_header,
    encode_header,
    file_size,
    frame_table,
)
from galahad.ports.cipher import Cipher

aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")

U16, U32, U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1
POOL = cf.ThreadPoolExecutor(2)


def segments(dims: st.SearchStrategy[int]) -> st.SearchStrategy[Segment]:
    return st.builds(
        Segment,
        group=st.integers(0, U16),
        kind=st.sampled_from(SegmentKind),
        dtype=st.sampled_from(DType),
        layer=st.integers(0, U32),
        shape=st.lists(dims, max_size=4).map(tuple),
    )


@st.composite
def headers(draw: st.DrawFn, dims: st.SearchStrategy[int] = st.integers(0, 2**10), max_segments: int = 6,
            frame_sizes: st.SearchStrategy[int] | None = None) -> BlockHeader:
    world = draw(st.integers(1, U32))
    start = draw(st.integers(0, U64 - 1))
    cipher_id = draw(st.sampled_from(CipherId))
    segs = draw(st.lists(segments(dims), max_size=max_segments))
    assume(sum(s.nbytes for s in segs) <= MAX_PAYLOAD_LEN)
    log_sizes = st.integers(MIN_FRAME_SIZE.bit_length() - 1, MAX_FRAME_SIZE.bit_length() - 1)
    return BlockHeader(
        namespace=draw(st.binary(min_size=32, max_size=32)),
        chain_key=draw(st.binary(min_size=32, max_size=32)),
        token_start=start,
        token_end=draw(st.integers(start + 1, U64)),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        block_size=draw(st.integers(1, U32)),
        segments=segs,
        frame_size=draw(log_sizes.map(lambda n: 1 << n) if frame_sizes is None else frame_sizes),
        cipher_id=cipher_id,
        key_id=bytes(8) if cipher_id == CipherId.XXH3 else draw(st.binary(min_size=8, max_size=8)),
        salt=draw(st.binary(min_size=16, max_size=16)),
        minor=draw(st.integers(0, U16)),
        incompat_flags=draw(st.sampled_from([0, INCOMPAT_ALIGNED])),  # v1.0's flat layout, or the aligned one
        compat_flags=draw(st.integers(0, U32)),
    )


@given(headers())
def test_decode_of_encode_is_the_header(h: BlockHeader) -> None:
    data = encode_header(h)
    assert len(data) == h.header_len
    assert decode_header(data) == h


@given(headers())
def test_encoding_in_pieces_gives_what_the_whole_declaration_builds(h: BlockHeader) -> None:
    """encode_header builds the fixed fields and the (cached) table apart: the same bytes as `_HEADER`."""
    from galahad.format import header as v1

    body = {name: getattr(h, name) for name in v1._FIELDS}
    body.update(major=v1.MAJOR, header_len=h.header_len, segment_count=len(h.segments), payload_len=h.payload_len,
                segments=[v1._segment_dict(s) for s in h.segments])
    assert encode_header(h) == v1._HEADER.build({"body": {"value": body}})


@given(st.one_of(headers().map(lambda h: encode_header(h)[:160]), st.binary(min_size=160, max_size=160)),
       st.lists(st.tuples(st.integers(0, 159), st.integers(0, 255)), max_size=3))
def test_the_compiled_parse_of_the_fixed_fields_is_the_declarations_parse(data: bytes,
                                                                        edits: list[tuple[int, int]]) -> None:
    """The preamble and fixed fields are parsed by their construct declarations, compiled: the
    same values as the declaration's own parse, and a refusal exactly where the declaration
    refuses (a reserved or magic field that is not what it must be)."""
    import construct as cs

    from galahad.domain.error import FormatError
    from galahad.format import header as v1

    raw = bytearray(data)
    for at, value in edits:
        raw[at] = value
    for flat, declaration, size in ((v1._PREAMBLE_FAST, v1._PREAMBLE, 24), (v1._FIXED_FAST, v1._FIXED, 160)):
        try:
            want = {k: v for k, v in declaration.parse(bytes(raw[:size])).items() if not k.startswith("_")}
        except cs.ConstError:
            with pytest.raises(FormatError, match="reserved bytes"):
                flat.parse(bytes(raw[:size]), "the fixed header")
            continue
        assert flat.parse(bytes(raw), "the fixed header") == want


@given(segments(st.integers(0, 2**20)), st.integers(0, 2**20))
def test_a_segment_knows_its_size_and_keeps_it_right_when_changed(segment: Segment, dim: int) -> None:
    assert segment.nbytes == math.prod(segment.shape) * segment.dtype.itemsize
    other = attrs.evolve(segment, shape=(dim, *segment.shape[1:]) if segment.shape else (dim,))
    assert other.nbytes == math.prod(other.shape) * other.dtype.itemsize
    assert (other == segment) == (other.shape == segment.shape) and hash(attrs.evolve(segment)) == hash(segment)


@given(headers(), st.binary(max_size=64))
def test_encode_of_decode_is_the_bytes(h: BlockHeader, tail: bytes) -> None:
    data = encode_header(h)
    assert encode_header(decode_header(data + tail)) == data  # only the header is read


@given(headers())
def test_frame_table_tiles_the_payload_and_the_file(h: BlockHeader) -> None:
    """Frames tile the payload; their bytes and tags tile the file after the header, with no gap."""
    assume(h.payload_len // h.frame_size < 10_000)
    plain, pieces = 0, []
    for i, frame in enumerate(frame_table(h)):
        assert (frame.index, frame.plain_offset) == (i, plain)
        assert 0 < frame.plain_len <= h.frame_size or h.payload_len == 0
        pieces += [(frame.data_offset, frame.plain_len), (frame.tag_offset, 16)]
        if h.aligned:  # the payload as it is in memory, at a page boundary; the tags in a table after it
            assert frame.data_offset == h.header_len + frame.plain_offset
            assert frame.tag_offset == h.header_len + h.payload_len + 16 * i
        else:  # v1.0: each frame followed by its tag
            assert frame.tag_offset == frame.data_offset + frame.plain_len
        plain += frame.plain_len
    assert plain == h.payload_len
    assert h.header_len % 4096 == 0 if h.aligned else h.header_len == 176 + 56 * len(h.segments)
    at = h.header_len
    for offset, length in sorted(pieces):
        assert offset == at
        at += length
    assert at == file_size(h)


small_blocks = headers(dims=st.integers(0, 24), max_segments=5, frame_sizes=st.sampled_from([4096, 8192]))


def _payload(h: BlockHeader, seed: int) -> list[bytes]:
    return [bytes((seed + i * 31 + j) % 251 for j in range(s.nbytes)) for i, s in enumerate(h.segments)]


ciphers = st.sampled_from(["xxh3", "aes"])
keys = st.binary(min_size=32, max_size=32)


def _cipher(kind: str, material: bytes) -> Cipher:
    return Xxh3FrameCheck() if kind == "xxh3" else aesgcm.AesGcmCipher(SecretKey(material))


@given(small_blocks, st.integers(0, 250), ciphers, keys, st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_open_of_seal_returns_the_payload(h: BlockHeader, seed: int, kind: str, material: bytes,
                                          use_pool: bool, use_out: bool, use_reader: bool, seal_out: bool) -> None:
    payload = _payload(h, seed)
    cipher = _cipher(kind, material)
    pool = POOL if use_pool else None
    room = memoryview(bytearray(file_size(h))) if seal_out else None  # more than enough
    blob = b"".join(seal_part(h, payload, cipher, pool=pool, out=room))
    out = bytearray(h.payload_len + 7) if use_out else None
    opened = (open_part_from if use_reader else open_part)(
        BufferReader(blob) if use_reader else blob,  # type: ignore[arg-type]
        expect=Expect(h.namespace, h.chain_key, h.rank, h.world), ciphers=cipher_lookup(cipher), pool=pool,
        out=None if out is None else memoryview(out))
    assert bytes(opened.payload) == b"".join(payload)
    assert [bytes(v) for v in opened.segment_views()] == payload
    if out is not None:
        assert opened.payload.obj is out  # written in place, not copied elsewhere
    written = attrs.evolve(h, cipher_id=cipher.cipher_id, key_id=cipher.key_id,
                           salt=opened.header.salt)
    assert opened.header == written
    assert len(blob) == file_size(written)


@given(small_blocks, st.integers(0, 250), ciphers, keys, st.binary(min_size=16, max_size=16))
def test_sealing_is_deterministic_given_the_salt(h: BlockHeader, seed: int, kind: str, material: bytes,
                                                salt: bytes) -> None:
    payload = _payload(h, seed)
    cipher = _cipher(kind, material)
    first = b"".join(seal_part(h, payload, cipher, salt=salt))
    again = b"".join(seal_part(read_header(first), payload, cipher, pool=POOL, salt=salt))
    assert first == again


def test_fresh_salts_make_different_files() -> None:
    h = BlockHeader(namespace=bytes(32), chain_key=bytes(32), token_start=0, token_end=16, rank=0, world=1,
                    block_size=16, segments=[Segment(0, 0, DType.U8, 0, (100,))], frame_size=4096)
    a, b = (b"".join(seal_part(h, [bytes(100)], Xxh3FrameCheck())) for _ in range(2))
    assert read_header(a).salt != read_header(b).salt
    assert a != b
