"""Hostile files, by the thousand: genuine parts (sealed and plain, one and several frames, both
layouts) mutated every way a store writer could, through every way a part is read and through
`galahad-format verify`. The claim: no crash (only `FormatError`, or the CLI's own statuses), no
hang, and no wrong bytes served (a file that opens at all opens as the genuine part, identity and
payload alike).

Mutations: bit flips, byte overwrites, runs of random bytes, cuts, appended bytes, whole header
fields randomised with the header checksum worked out again (a forger can: it has no key), and
frames swapped between two genuine files. A seeded generator: the same mutations every run. CI
runs 3,000 of them; the slow campaign (`--run-slow`) 50,000, and prints its totals.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from galahad.cli.format import main as format_main
from galahad.format.codec import BufferReader, Expect, cipher_lookup, open_part, open_part_from, seal_part, verify_part
from galahad.domain.error import FormatError
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, DType, Segment, SegmentKind

aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")

CHECK = Xxh3FrameCheck()
AES = aesgcm.AesGcmCipher(SecretKey(bytes(range(1, 33))))
READER = cipher_lookup(CHECK, AES)
POOL = cf.ThreadPoolExecutor(2)


def _header(segments: list[Segment], **over: object) -> BlockHeader:
    fields: dict[str, object] = dict(namespace=b"N" * 32, chain_key=b"K" * 32, token_start=0, token_end=32,
                                     rank=0, world=1, block_size=16, segments=segments, frame_size=4096)
    fields.update(over)
    return BlockHeader(**fields)  # type: ignore[arg-type]


def _genuine() -> dict[str, tuple[bytes, bytes]]:
    """name -> (file, payload) of each genuine part mutated here (its header: `HEADERS`)."""
    one = [Segment(0, SegmentKind.KV, DType.BF16, 0, (2, 4, 8)), Segment(1, SegmentKind.STATE, DType.F32, 3, (43,))]
    three = [Segment(0, SegmentKind.KV, DType.U8, 0, (3 * 4096 + 77,))]
    out = {}
    for shape_name, segments in (("one-frame", one), ("three-frames", three)):
        for layout, over in (("aligned", {}), ("flat", {"minor": 0, "incompat_flags": 0})):
            h = _header(segments, **over)
            payload = [bytes((i * 13 + k) % 251 for i in range(s.nbytes)) for k, s in enumerate(h.segments)]
            for cipher_name, cipher in (("plain", CHECK), ("sealed", AES)):
                blob = b"".join(seal_part(h, payload, cipher, salt=b"S" * 16))  # type: ignore[arg-type]
                out[f"{cipher_name}-{shape_name}-{layout}"] = (blob, b"".join(payload))
    return out


GENUINE = _genuine()
HEADERS = {name: open_part(blob, expect=Expect(), ciphers=READER).header for name, (blob, _p) in GENUINE.items()}
def _opened(part: object) -> tuple[BlockHeader, bytes | None]:
    return part.header, bytes(part.payload)  # type: ignore[attr-defined]


# each way a part is read: its header and payload (verify_part keeps no payload)
ENTRIES: dict[str, Callable[[bytes], tuple[BlockHeader, bytes | None]]] = {
    "open_part": lambda b: _opened(open_part(b, expect=Expect(), ciphers=READER)),
    "open_part_from": lambda b: _opened(open_part_from(BufferReader(b), expect=Expect(), ciphers=READER)),
    "open_part_from_pool": lambda b: _opened(open_part_from(BufferReader(b), expect=Expect(), ciphers=READER,
                                                            pool=POOL)),
    "verify_part": lambda b: (verify_part(b, expect=Expect(), ciphers=READER), None),
}


def _resign(data: bytearray) -> None:
    """Work the header checksum out again, as a forger can (it has no key)."""
    header_len = int.from_bytes(data[20:24], "little")
    if 24 <= header_len <= len(data):
        data[header_len - 16:header_len] = xxhash.xxh3_128_digest(bytes(data[:header_len - 16]))


def _mutate(rng: random.Random, blob: bytes, other: bytes) -> tuple[str, bytes]:
    data = bytearray(blob)
    kind = rng.choice(("flip", "overwrite", "run", "cut", "append", "header-field", "swap-frames"))
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
    elif kind == "overwrite":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "run":
        at = rng.randrange(len(data))
        data[at:at + rng.randint(1, 64)] = rng.randbytes(rng.randint(1, 64))
    elif kind == "cut":
        del data[rng.randrange(len(data)):]
    elif kind == "append":
        data += rng.randbytes(rng.randint(1, 5000))
    elif kind == "header-field":  # a field of the clear header set to anything, the checksum made to match
        at = rng.randrange(24, min(len(data), 300))
        width = rng.choice((1, 2, 4, 8))
        data[at:at + width] = rng.randbytes(width)
        _resign(data)
    else:  # frames of another genuine file of the same shape, from a random offset on
        at = rng.randrange(len(data) // 2, len(data))
        data[at:] = other[at:len(data)] if len(other) >= len(data) else data[at:]
    return kind, bytes(data)


def _campaign(count: int, seed: int, folder: Path) -> Counter[str]:
    rng = random.Random(seed)
    names = sorted(GENUINE)
    totals: Counter[str] = Counter()
    cli_files = []
    for n in range(count):
        name = rng.choice(names)
        blob, payload = GENUINE[name]
        twin = name.replace("plain", "sealed") if "plain" in name else name.replace("sealed", "plain")
        kind, data = _mutate(rng, blob, GENUINE[twin][0])
        if data == blob:
            totals["unchanged (skipped)"] += 1
            continue
        totals["mutated files"] += 1
        totals[f"mutation {kind}"] += 1
        for entry, read in ENTRIES.items():
            try:
                got = read(data)
            except FormatError:
                totals["refused"] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - what the campaign looks for
                pytest.fail(f"{entry} crashed on a {kind} of {name} (mutation {n}): {type(exc).__name__}: {exc}")
            totals["opened"] += 1
            header, got_payload = got
            if header != HEADERS[name] or (got_payload is not None and got_payload != payload):
                pytest.fail(f"{entry} served a wrong part for a {kind} of {name} (mutation {n})")
        if n % 25 == 0:
            cli_files.append(data)
    key_file = folder / "store.key"
    key_file.write_text(bytes(range(1, 33)).hex() + "\n")
    key_file.chmod(0o600)
    for chunk in range(0, len(cli_files), 200):
        store = folder / f"store{chunk}"
        ns = store / f"ns-{'e' * 64}"  # the store's layout: ns-<digest>/<k[0:2]>/<k[2:4]>/<k>.p0.blk
        for i, data in enumerate(cli_files[chunk:chunk + 200]):
            name = f"{i:064x}"
            leaf = ns / name[0:2] / name[2:4]
            leaf.mkdir(mode=0o700, parents=True, exist_ok=True)
            (leaf / f"{name}.p0.blk").write_bytes(data)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            status = format_main(["verify", "--key-file", str(key_file), str(store)])
        assert status in (0, 1, 3), (status, out.getvalue()[-2000:])
        totals["cli verify runs"] += 1
        totals["cli files"] += len(cli_files[chunk:chunk + 200])
    return totals


def test_mutated_files_never_crash_a_reader_nor_serve_wrong_bytes(tmp_path: Path) -> None:
    totals = _campaign(3000, seed=1, folder=tmp_path)
    assert totals["mutated files"] > 2500 and totals["refused"] > 0


@pytest.mark.slow
def test_fifty_thousand_mutated_files_never_crash_a_reader_nor_serve_wrong_bytes(tmp_path: Path) -> None:
    totals = _campaign(50_000, seed=2, folder=tmp_path)
    print("mutation campaign:", dict(sorted(totals.items())))
    assert totals["mutated files"] > 45_000
