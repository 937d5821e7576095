#!/usr/bin/env python3
"""Independent oracle for spec/format-v1.md: writes the test vectors and vectors.json.

It implements the spec from its text with `struct`, `hashlib`, `xxhash` and (for the sealed
vectors) `cryptography`, and never imports galahad: the vectors check the code, not the other
way round. Deterministic: running it again writes the same bytes. Run from anywhere:

    python spec/vectors/make_vectors.py          # rewrite the files beside this script
    python spec/vectors/make_vectors.py --check  # exit 1 if the committed files differ
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from pathlib import Path

import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HERE = Path(__file__).resolve().parent

MAGIC = b"GALAHAD\x1a"
FIXED = struct.Struct("<8sHHIII32s32sQQIIIH2s8s16sIIQ")  # spec §3, 160 bytes
SEGMENT = struct.Struct("<HBBIB7s4QQ")  # spec §4, 56 bytes
ITEMSIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 1, 6: 1, 7: 1, 8: 1, 9: 4, 10: 8, 11: 8}
DTYPE_NAME = {0: "u8", 1: "i8", 2: "bf16", 3: "f16", 4: "f32", 5: "f8_e4m3fn", 6: "f8_e5m2",
              7: "f8_e4m3fnuz", 8: "f8_e5m2fnuz", 9: "i32", 10: "i64", 11: "f64"}

ALIGNED = 0x1  # incompat flag bit 0 (v1.1): header padded to 4096, payload contiguous, tag table after it
PAGE = 4096
TEST_KEY = bytes(range(0x40, 0x60))  # the AES-256 master key of the sealed vectors (test only!)
TEST_KEY_ID = hashlib.sha256(b"galahad-key-id-v1\x00" + TEST_KEY).digest()[:8]
OTHER_NAMESPACE = hashlib.sha256(b"vectors: another namespace").digest()

assert FIXED.size == 160 and SEGMENT.size == 56


def det_bytes(label: str, n: int) -> bytes:
    """n deterministic pseudo-random bytes (SHA-256 in counter mode)."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def seg(group: int, kind: int, dtype: int, layer: int, dims: tuple[int, ...], **over: object) -> dict:
    nbytes = math.prod(dims) * ITEMSIZE.get(dtype, 1)
    s = {"group": group, "kind": kind, "dtype": dtype, "layer": layer, "ndim": len(dims),
         "shape": list(dims) + [0] * (4 - len(dims)), "nbytes": nbytes, "reserved": bytes(7)}
    s.update(over)
    return s


def base_fields(name: str) -> dict:
    return {
        "magic": MAGIC, "major": 1, "minor": 0, "incompat_flags": 0, "compat_flags": 0,
        "namespace": hashlib.sha256(b"vectors: namespace").digest(),
        "chain_key": hashlib.sha256(f"vectors: chain key {name}".encode()).digest(),
        "token_start": 0, "token_end": 64, "rank": 0, "world": 1, "block_size": 16,
        "cipher_id": 0, "reserved": bytes(2), "key_id": bytes(8),
        "salt": hashlib.sha256(f"vectors: salt {name}".encode()).digest()[:16],
        "frame_size": 4096,
    }


def aligned(f: dict) -> bool:
    return bool(f["incompat_flags"] & ALIGNED)


def build_header(f: dict, segments: list[dict], *, extra: bytes = b"", corrupt_checksum: bool = False,
                 pad: bool | None = None) -> bytes:
    """Header bytes per spec §3-§4: fixed fields, segment table, (aligned layout: zero padding up
    to a multiple of 4096), XXH3-128 checksum. `pad` overrides whether the padding is added."""
    count = f.get("segment_count", len(segments))
    unpadded = 160 + 56 * len(segments) + len(extra) + 16
    if aligned(f) if pad is None else pad:
        extra += bytes(-(-unpadded // PAGE) * PAGE - unpadded)
    header_len = f.get("header_len", 160 + 56 * len(segments) + len(extra) + 16)
    payload_len = f.get("payload_len", sum(s["nbytes"] for s in segments))
    body = FIXED.pack(
        f["magic"], f["major"], f["minor"], f["incompat_flags"], f["compat_flags"], header_len,
        f["namespace"], f["chain_key"], f["token_start"], f["token_end"], f["rank"], f["world"],
        f["block_size"], f["cipher_id"], f["reserved"], f["key_id"], f["salt"], f["frame_size"],
        count, payload_len,
    )
    for s in segments:
        body += SEGMENT.pack(s["group"], s["kind"], s["dtype"], s["layer"], s["ndim"], s["reserved"],
                             *s["shape"], s["nbytes"])
    body += extra
    checksum = xxhash.xxh3_128(body).digest()  # canonical (big-endian) byte order
    if corrupt_checksum:
        checksum = bytes([checksum[0] ^ 0x01]) + checksum[1:]
    return body + checksum


def frame_key(salt: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=b"galahad-v1-frame-key").derive(TEST_KEY)


def seal_frames(header: bytes, f: dict, payload: bytes) -> bytes:
    """What follows the header, per spec §2 and §5: at least one frame; flat layout, each frame
    followed by its 16-byte tag; aligned layout, the stored frames back to back, then the tags."""
    size = f["frame_size"]
    count = max(1, -(-len(payload) // size))
    stored, tags = [], []
    for i in range(count):
        frame = payload[i * size : (i + 1) * size]
        index = struct.pack("<Q", i)
        if f["cipher_id"] == 0:
            seed = xxhash.xxh3_64_intdigest(f["salt"] + header + index)
            sealed = frame + xxhash.xxh3_128(frame, seed=seed).digest()
        else:
            nonce = bytes(4) + index
            sealed = AESGCM(frame_key(f["salt"])).encrypt(nonce, frame, header + index)
        stored.append(sealed[:-16])
        tags.append(sealed[-16:])
    if aligned(f):
        return b"".join(stored) + b"".join(tags)
    return b"".join(c + t for c, t in zip(stored, tags))


def describe(f: dict, segments: list[dict], header: bytes, payload: bytes, blob: bytes) -> dict:
    frames = max(1, -(-len(payload) // f["frame_size"]))
    return {
        "header": {
            "major": f["major"], "minor": f["minor"], "incompat_flags": f["incompat_flags"],
            "compat_flags": f["compat_flags"], "header_len": len(header),
            "namespace": f["namespace"].hex(), "chain_key": f["chain_key"].hex(),
            "token_start": f["token_start"], "token_end": f["token_end"], "rank": f["rank"],
            "world": f["world"], "block_size": f["block_size"], "cipher_id": f["cipher_id"],
            "key_id": f["key_id"].hex(), "salt": f["salt"].hex(), "frame_size": f["frame_size"],
            "segment_count": len(segments), "payload_len": len(payload),
        },
        "segments": [
            {"group": s["group"], "kind": s["kind"], "dtype": s["dtype"], "dtype_name": DTYPE_NAME[s["dtype"]],
             "layer": s["layer"], "shape": s["shape"][: s["ndim"]], "nbytes": s["nbytes"]}
            for s in segments
        ],
        "frame_count": frames,
        "file_size": len(blob),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }


def make_file(name: str, segments: list[dict], *, payload: bytes | None = None, extra: bytes = b"",
              corrupt_checksum: bool = False, pad: bool | None = None, **over: object
              ) -> tuple[bytes, dict, bytes, bytes]:
    f = base_fields(name)
    f.update(over)
    if payload is None:
        payload = det_bytes(name, sum(s["nbytes"] for s in segments))
    header = build_header(f, segments, extra=extra, corrupt_checksum=corrupt_checksum, pad=pad)
    return header + seal_frames(header, f, payload), f, header, payload


def flip(blob: bytes, offset: int, mask: int = 0x01) -> bytes:
    return blob[:offset] + bytes([blob[offset] ^ mask]) + blob[offset + 1 :]


KV = [seg(0, 0, 2, layer, (2, 16, 4, 8)) for layer in range(3)]  # 3 layers of bf16 KV, 2048 B each
STATE = seg(1, 1, 4, 0, (4, 64))  # an f32 state, 1024 B
SCALAR = seg(1, 1, 4, 1, ())  # ndim 0: one f32
RAW = seg(2, 0, 0, 0, (100,))  # raw bytes


def vectors() -> list[tuple[str, bytes | None, dict]]:
    """(name, file bytes or None for a reader case that reuses another vector's file, entry)."""
    out: list[tuple[str, bytes | None, dict]] = []

    def valid(name: str, text: str, segments: list[dict], **kw: object) -> bytes:
        blob, f, header, payload = make_file(name, segments, **kw)
        out.append((name, blob, {"description": text, "valid": True, **describe(f, segments, header, payload, blob)}))
        return blob

    def invalid(name: str, text: str, blob: bytes, error: str, **extra: object) -> None:
        out.append((name, blob, {"description": text, "valid": False, "error": error, **extra}))

    def reader_case(name: str, text: str, file: str, error: str | None, reader: dict) -> None:
        outcome = {"valid": True, "same_as": file} if error is None else {"valid": False, "error": error}
        out.append((name, None, {"file": f"{file}.blk", "description": f"{file}.blk {text}", **outcome,
                                 "reader": reader}))

    one = valid("plain-one-segment", "cipher 0, one bf16 KV segment, one frame", [seg(0, 0, 2, 0, (2, 16, 2, 8))])
    multi = valid(
        "plain-multi-segment",
        "cipher 0, six segments (KV, state, a 0-dimension scalar, raw bytes) over two frames; "
        "segments cross the frame boundary",
        [*KV, STATE, SCALAR, RAW],
        rank=1, world=2, token_start=64, token_end=128,
    )
    valid("plain-empty-payload", "cipher 0, one segment with a zero dimension: payload 0 bytes, one empty frame",
          [seg(0, 0, 3, 0, (0, 16))])
    sealed = valid("sealed-aes-gcm", "cipher 1 (AES-256-GCM) under the test key, two segments, two frames",
                   [KV[0], seg(0, 0, 2, 1, (3000,))], cipher_id=1, key_id=TEST_KEY_ID, frame_size=4096)
    valid("compat-flags-unknown", "unknown compat flag bits: read as usual", [KV[0]], compat_flags=0x80000001)
    valid("minor-newer", "a newer minor version of major 1: read as usual", [KV[0]], minor=9)
    two_full = valid("plain-two-full-frames", "cipher 0, payload exactly two frames", [seg(0, 0, 0, 0, (8192,))])

    # -- refused: not a block, or not one we read
    invalid("not-a-block", "a text file", b"hello, this is not a Galahad block\n", "FormatError")
    invalid("bad-magic", "magic byte 0 changed", flip(one, 0, 0x20), "FormatError")
    invalid("empty", "an empty file (a torn write)", b"", "IntegrityError")
    invalid("future-major", "major version 2", make_file("future-major", [KV[0]], major=2)[0], "NewerFormat")
    invalid("major-zero", "major version 0", make_file("major-zero", [KV[0]], major=0)[0], "FormatError")
    invalid("unknown-incompat-flag", "incompat flag bit 1 set, which no version assigns (checksum valid)",
            make_file("unknown-incompat-flag", [KV[0]], incompat_flags=0x2)[0], "NewerFormat")
    invalid("aligned-and-unknown-incompat-flag", "aligned layout with incompat flag bit 31 set as well",
            make_file("aligned-and-unknown-incompat-flag", [KV[0]], minor=1, incompat_flags=0x80000001)[0],
            "NewerFormat")
    # -- refused: damaged (IntegrityError)
    invalid("truncated-header", "the first 100 bytes of plain-one-segment", one[:100], "IntegrityError")
    invalid("truncated-preamble", "the first 20 bytes of plain-one-segment", one[:20], "IntegrityError")
    invalid("truncated-payload", "plain-multi-segment without its last byte", multi[:-1], "IntegrityError")
    invalid("trailing-bytes", "plain-multi-segment with one byte appended", multi + b"\x00", "IntegrityError")
    invalid("header-checksum-bad", "header checksum with one bit flipped",
            make_file("header-checksum-bad", [KV[0]], corrupt_checksum=True)[0], "IntegrityError")
    invalid("header-field-flipped", "token_end with one bit flipped, checksum not updated",
            flip(one, 96), "IntegrityError")
    hl = 160 + 56 + 16
    invalid("frame-data-bad", "one payload bit flipped in frame 0", flip(one, hl + 10), "IntegrityError")
    invalid("frame-tag-bad", "one bit of frame 0's tag flipped", flip(one, len(one) - 1), "IntegrityError")
    h2 = 160 + 56 + 16
    a, b = two_full[h2 : h2 + 4112], two_full[h2 + 4112 :]
    invalid("frames-swapped", "plain-two-full-frames with its two sealed frames swapped",
            two_full[:h2] + b + a, "IntegrityError")
    blob, f, header, payload = make_file("plain-header-edited", [KV[0]])
    edited = dict(f, token_end=f["token_end"] + 16)
    invalid("plain-header-edited", "cipher 0: token_end changed and the header checksum recomputed; "
            "frame tags no longer match", build_header(edited, [KV[0]]) + blob[len(header):], "IntegrityError")
    invalid("sealed-tag-bad", "sealed-aes-gcm with one bit of frame 1's tag flipped",
            flip(sealed, len(sealed) - 1), "IntegrityError")
    blob, f, header, payload = make_file("sealed-header-edited", [KV[0]], cipher_id=1, key_id=TEST_KEY_ID)
    edited = dict(f, rank=0, world=2)
    invalid("sealed-header-edited", "cipher 1: world changed and the header checksum recomputed; "
            "AES-GCM tags no longer match", build_header(edited, [KV[0]]) + blob[len(header):], "IntegrityError")
    # -- refused: malformed header (FormatError, checksum valid)
    def bad(name: str, text: str, segments: list[dict] | None = None, **over: object) -> None:
        invalid(name, text, make_file(name, segments if segments is not None else [KV[0]], **over)[0], "FormatError")

    bad("payload-len-not-sum", "payload_len one more than the sum of the segment lengths",
        payload_len=KV[0]["nbytes"] + 1, payload=det_bytes("x", KV[0]["nbytes"] + 1))
    bad("segment-nbytes-not-shape", "a segment whose byte length is not shape x dtype size",
        [seg(0, 0, 2, 0, (2, 16, 4, 8), nbytes=2047)])
    invalid("header-len-absurd", "header_len 0xFFFFFFFF", make_file("header-len-absurd", [KV[0]], header_len=0xFFFFFFFF)[0][:512],
            "FormatError")
    bad("header-len-too-small", "header_len 100, below the fixed part", header_len=100)
    invalid("header-len-not-table", "header_len 56 bytes more than the segment table needs (checksum valid)",
            make_file("header-len-not-table", [KV[0]], extra=bytes(56))[0], "FormatError")
    invalid("payload-len-absurd", "one raw segment of 2^50 bytes (over the 2^40 limit); the file is small",
            make_file("payload-len-absurd", [seg(0, 0, 0, 0, (1 << 50,))], payload=b"")[0], "FormatError")
    bad("segment-count-absurd", "segment_count 0xFFFFFFFF with a one-segment header", segment_count=0xFFFFFFFF)
    bad("frame-size-not-power-of-two", "frame_size 5000", frame_size=5000)
    bad("frame-size-too-small", "frame_size 2048", frame_size=2048)
    bad("rank-not-below-world", "rank 2 of world 2", rank=2, world=2)
    bad("world-zero", "world 0", rank=0, world=0)
    bad("empty-token-range", "token_start == token_end", token_start=64, token_end=64)
    bad("block-size-zero", "block_size 0", block_size=0)
    bad("reserved-nonzero", "the reserved bytes after cipher_id are not zero", reserved=b"\x00\x01")
    bad("segment-reserved-nonzero", "a segment's reserved bytes are not zero",
        [seg(0, 0, 2, 0, (2, 16, 4, 8), reserved=b"\x01" + bytes(6))])
    bad("cipher-unknown", "cipher id 7", cipher_id=7)
    bad("cipher0-key-id-nonzero", "cipher 0 with a non-zero key id", key_id=b"\x01" * 8)
    bad("dtype-unknown", "dtype code 200", [seg(0, 0, 200, 0, (16,))])
    bad("kind-unknown", "segment kind 5", [seg(0, 5, 2, 0, (2, 16, 4, 8))])
    bad("ndim-too-large", "ndim 5", [seg(0, 0, 0, 0, (1, 1, 1, 16), ndim=5)])
    bad("shape-unused-nonzero", "a shape entry beyond ndim is not zero",
        [seg(0, 0, 0, 0, (16,), shape=[16, 0, 7, 0])])

    # -- the aligned layout (v1.1, incompat flag bit 0)
    al = dict(minor=1, incompat_flags=ALIGNED)
    a_one = valid("aligned-one-segment", "aligned layout, cipher 0, one bf16 KV segment, one frame",
                  [seg(0, 0, 2, 0, (2, 16, 2, 8))], **al)
    a_multi = valid(
        "aligned-multi-segment",
        "aligned layout, cipher 0, six segments (KV, state, a 0-dimension scalar, raw bytes) over two "
        "frames; segments cross the frame boundary",
        [*KV, STATE, SCALAR, RAW], rank=1, world=2, token_start=64, token_end=128, **al,
    )
    valid("aligned-empty-payload", "aligned layout, a zero-length payload: the header, then one tag",
          [seg(0, 0, 3, 0, (0, 16))], **al)
    a_two = valid("aligned-two-full-frames", "aligned layout, payload exactly two frames",
                  [seg(0, 0, 0, 0, (8192,))], **al)
    a_sealed = valid("aligned-sealed-aes-gcm", "aligned layout, cipher 1 under the test key, two segments, two frames",
                     [KV[0], seg(0, 0, 2, 1, (3000,))], cipher_id=1, key_id=TEST_KEY_ID, **al)
    valid("aligned-large-header", "aligned layout, 80 segments: the header rounds up to 8192 bytes",
          [seg(0, 0, 0, layer, (64,)) for layer in range(80)], **al)
    valid("aligned-minor-zero", "the aligned flag in a file that says minor 0: the flag decides the layout",
          [KV[0]], minor=0, incompat_flags=ALIGNED)
    ah = PAGE  # the header length of every aligned vector but the large one
    invalid("aligned-header-not-padded", "aligned flag set, header_len 176 + 56 x 1 (not rounded up; checksum valid)",
            make_file("aligned-header-not-padded", [KV[0]], pad=False, **al)[0], "FormatError")
    invalid("flat-header-padded", "no aligned flag, header padded to 4096 bytes with zeros (checksum valid)",
            make_file("flat-header-padded", [KV[0]], pad=True)[0], "FormatError")
    blob, f, header, payload = make_file("aligned-padding-nonzero", [KV[0]], **al)
    body = header[:-16]
    body = body[:1000] + b"\x01" + body[1001:]  # a byte of the padding (the table ends at 216)
    header = body + xxhash.xxh3_128(body).digest()
    invalid("aligned-padding-nonzero", "a byte of the header padding is 1 (checksum and tags recomputed)",
            header + seal_frames(header, f, payload), "FormatError")
    invalid("aligned-padding-flipped", "a bit of the header padding flipped, checksum not updated",
            flip(a_one, 2000), "IntegrityError")
    invalid("aligned-truncated-tags", "aligned-multi-segment without its last byte (a tag cut short)",
            a_multi[:-1], "IntegrityError")
    invalid("aligned-truncated-payload", "aligned-multi-segment cut inside its payload", a_multi[: ah + 5000],
            "IntegrityError")
    invalid("aligned-trailing-bytes", "aligned-multi-segment with one byte appended", a_multi + b"\x00", "IntegrityError")
    invalid("aligned-frame-data-bad", "aligned layout, one payload bit flipped in frame 0", flip(a_one, ah + 10),
            "IntegrityError")
    invalid("aligned-frame-tag-bad", "aligned layout, one bit of the tag table flipped", flip(a_one, len(a_one) - 1),
            "IntegrityError")
    tags = len(a_two) - 32
    invalid("aligned-tags-swapped", "aligned-two-full-frames with the two tags of its tag table swapped",
            a_two[:tags] + a_two[tags + 16 :] + a_two[tags : tags + 16], "IntegrityError")
    invalid("aligned-frames-swapped", "aligned-two-full-frames with its two frames swapped (tags in place)",
            a_two[:ah] + a_two[ah + 4096 : ah + 8192] + a_two[ah : ah + 4096] + a_two[tags:], "IntegrityError")
    invalid("aligned-sealed-tag-bad", "aligned-sealed-aes-gcm with one bit of frame 1's tag flipped",
            flip(a_sealed, len(a_sealed) - 1), "IntegrityError")
    invalid("aligned-sealed-data-bad", "aligned-sealed-aes-gcm with one ciphertext bit of frame 1 flipped",
            flip(a_sealed, ah + 4096 + 7), "IntegrityError")

    # -- readers that expect something else (the file itself is valid)
    reader_case("foreign-namespace", "read by a reader of another namespace", "plain-one-segment",
                "ForeignBlock", {"expect": {"namespace": OTHER_NAMESPACE.hex()}})
    reader_case("foreign-chain-key", "read as another entry", "plain-one-segment",
                "ForeignBlock", {"expect": {"chain_key": OTHER_NAMESPACE.hex()}})
    reader_case("foreign-rank", "rank 1 read as rank 0", "plain-multi-segment", "ForeignBlock", {"expect": {"rank": 0}})
    reader_case("foreign-world", "world 2 read by a world of 4", "plain-multi-segment", "ForeignBlock",
                {"expect": {"world": 4}})
    reader_case("unknown-key", "read by a reader holding no key", "sealed-aes-gcm", "UnknownKey", {"keys": []})
    reader_case("aligned-unknown-key", "read by a reader holding no key", "aligned-sealed-aes-gcm", "UnknownKey",
                {"keys": []})
    reader_case("aligned-foreign-rank", "rank 1 read as rank 0", "aligned-multi-segment", "ForeignBlock",
                {"expect": {"rank": 0}})
    reader_case("checksum-refused-by-sealed-reader", "cipher 0 read by a reader that accepts sealed files only",
                "plain-one-segment", "UnknownKey", {"accept_checksum": False})
    reader_case("expected-fields-match", "read by a reader expecting exactly its namespace, key, rank and world",
                "plain-multi-segment", None, {"expect": {
                    "namespace": hashlib.sha256(b"vectors: namespace").digest().hex(),
                    "chain_key": hashlib.sha256(b"vectors: chain key plain-multi-segment").digest().hex(),
                    "rank": 1, "world": 2}})
    return out


def render() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    listing = {
        "format": "galahad block file v1 (spec/format-v1.md)",
        "generator": "spec/vectors/make_vectors.py (struct, hashlib, xxhash, cryptography; no galahad)",
        "default_reader": {"accept_checksum": True, "keys": [TEST_KEY.hex()], "expect": {}},
        "keys": [{"material": TEST_KEY.hex(), "key_id": TEST_KEY_ID.hex(), "note": "test key: never use it"}],
        "vectors": [],
    }
    for name, blob, entry in vectors():
        if blob is not None:
            files[f"{name}.blk"] = blob
        listing["vectors"].append({"name": name, "file": f"{name}.blk", "reader": {}, **entry})
    files["vectors.json"] = (json.dumps(listing, indent=1) + "\n").encode()
    return files


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [n for n, data in files.items() if not (HERE / n).is_file() or (HERE / n).read_bytes() != data]
        for name in stale:
            print(f"stale or missing: {name}")
        return 1 if stale else 0
    for name, data in files.items():
        (HERE / name).write_bytes(data)
    print(f"wrote {len(files)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
