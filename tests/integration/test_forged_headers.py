"""Part files forged to claim sizes they do not hold cost what their first frame costs, never what
they claim: a counted, quarantined miss from the service, one BAD line from `galahad-format`.

The forger can write the store folder, and nothing more: they take a genuine part's header as the
service's own writer wrote it, change the sizes it claims (the segment table, hence the payload
length and the frame count, up to the format's 1 TiB), work the header checksum out again (it has
no key: anyone can) and leave the rest of the file a hole, a sparse file of a few KiB on disk
whose size is the one the forged header gives. A sealed part keeps its genuine tags, now wrong
(the header is their associated data, and they cannot be made again without the key); a plain
part gets zero tags. The commit marker is rewritten to list the new size.

Before anything is allocated or iterated by such a claim, it is compared with what the caller
expects: the segment table the engine expects, the buffer it reads into. Where a caller has no
expectation, the payload goes to memory the kernel gives as frames arrive, and a claim it cannot
map at all is refused. Real stores, real files, real processes for the helpers; memory is the
process's peak resident size (VmHWM, reset before each load) and, for what Python allocates,
tracemalloc's peak.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from galahad.adapters.crypto.key import Keyring
from galahad.adapters.fs import marker
from galahad.cli.format import main
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.secret import SecretKey
from galahad.format.v1 import BlockHeader, CipherId, DType, Segment, SegmentKind, decode_header, encode_header, file_size
from galahad.adapters.helpers.pool import HelperRecipe, HelperPool, SharedRegion
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import LAYERS, helper_service

SHAPE = (4, 2, 16, 64)  # float32: 32 KiB a layer, 128 KiB a part, one 4 MiB frame
SPECS = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
TIB = 1 << 40
MATERIAL = bytes(range(32))


def _saved(svc: KVCacheService, n: int = 1) -> tuple[list[ChainKey], list[bytes]]:
    """`n` genuine entries of one part each, saved and committed by the service's own writer."""
    keys = svc.keys(list(range(n * 64 + 1)), svc.seed())
    entries, payloads = [], []
    for i in range(n):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        payload = [os.urandom(4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]) for _ in range(LAYERS)]
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, SPECS, payload) and svc.commit(key)
        entries.append(key)
        payloads.append(b"".join(payload))
    return entries, payloads


def _part_file(root: Path, key: ChainKey) -> Path:
    (found,) = (p for p in root.rglob(f"{key.hex}.p0.blk") if "quarantine" not in p.parts)
    return found


def _forge(path: Path, **claims: object) -> BlockHeader:
    """Rewrite the part at `path` with its genuine header's fields but `claims`, the header's
    checksum worked out again, and a hole up to the size that header gives; its commit marker
    lists that size. Tags: a sealed part's stay as they were, a plain part's become zeros."""
    genuine = decode_header(path.read_bytes())
    forged = attrs.evolve(genuine, **claims)
    with open(path, "r+b") as f:
        tags = f.read()[genuine.header_len + genuine.payload_len :] if forged.cipher_id != CipherId.XXH3 else b""
        f.seek(0)
        f.truncate(0)
        f.write(encode_header(forged))
        f.seek(forged.header_len + forged.payload_len)
        f.write(tags)
        f.truncate(file_size(forged))
    ok = path.parent / f"{path.name.split('.')[0]}.ok"
    ok.write_bytes(marker.encode({0: file_size(forged)}))
    assert path.stat().st_size == file_size(forged) and path.stat().st_blocks * 512 <= 1 << 20  # sparse
    return forged


def _one_segment(nbytes: int) -> tuple[Segment, ...]:
    return (Segment(0, SegmentKind.KV, DType.U8, 0, (nbytes,)),)


def _status(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert found is not None
    return int(found.group(1)) << 10


@contextlib.contextmanager
def _peak_growth() -> Iterator[list[int]]:
    """Yields a list that holds, after the block, how far this process's peak resident memory
    rose above what it held when the block began (VmHWM, reset first: mapped memory too)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak resident size")
    before, grew = _status("VmRSS"), []
    yield grew
    grew.append(_status("VmHWM") - before)


@contextlib.contextmanager
def _python_peak() -> Iterator[list[int]]:
    """Yields a list that holds, after the block, tracemalloc's peak of Python allocations."""
    tracemalloc.start()
    got: list[int] = []
    try:
        yield got
        got.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- the service's load path


@pytest.mark.parametrize("claim", [TIB, 1 << 30], ids=["1-TiB", "1-GiB"])
def test_a_sealed_part_forged_to_claim_a_huge_payload_is_a_quarantined_miss_that_costs_one_frame(
        tmp_path: Path, claim: int) -> None:
    """A load with no buffer of the caller's (vLLM on the CPU, a read-ahead): a 1 TiB claim used
    to raise MemoryError out of `load_part` (never quarantined, tried again by every request); a
    1 GiB one, under the free memory, took 1 GiB before its first frame failed (a few such loads
    at once kill the worker). Now each is a miss, counted, quarantined, and the process's peak
    memory grows by a few frames at most."""
    svc = helper_service(tmp_path / "store", Keyring(SecretKey(MATERIAL)))
    try:
        (key,), _ = _saved(svc)
        _forge(_part_file(tmp_path / "store", key), segments=_one_segment(claim))
        with _peak_growth() as grew:
            assert svc.load_part(key, 0) is None  # never an exception
        c = svc.counters
        assert c.load_failures == 1 and c.quarantined == 1 and sum(c.refused.values()) == 1, c
        # 1 GiB maps, and its first frame fails its tag; 1 TiB is more than the machine maps
        assert set(c.refused) <= {"damaged", "format"} and (claim == TIB or c.refused == {"damaged": 1}), c
        assert not svc.store.is_committed(key)
        assert grew[0] < 64 << 20, f"the peak grew by {grew[0] >> 20} MiB"
    finally:
        svc.close()


def test_a_load_into_the_engines_buffer_refuses_a_million_frame_claim_before_any_frame_is_made(
        tmp_path: Path) -> None:
    """A load on a GPU reads into a pinned buffer the engine sized for the entry. A plain part
    forged to claim 4 GiB in 4 KiB frames (a million frames) is compared with that buffer first:
    refused (`refused_format`), quarantined, no tag table read and nothing sized by the claim
    allocated."""
    svc = helper_service(tmp_path / "store")
    try:
        (key,), (payload,) = _saved(svc)
        _forge(_part_file(tmp_path / "store", key), frame_size=4096, segments=_one_segment(4 << 30))
        out = memoryview(bytearray(len(payload)))
        with _python_peak() as peak:
            t0 = time.perf_counter()
            assert svc.load_part(key, 0, out=out) is None
            elapsed = time.perf_counter() - t0
        assert svc.counters.refused == {"format": 1} and svc.counters.quarantined == 1
        assert peak[0] < 8 << 20 and elapsed < 1.0, (peak[0], elapsed)
    finally:
        svc.close()


@pytest.mark.parametrize("sealed, expects", [
    (True, "segments"),  # the engine's segment table (`load_part(segments=...)`)
    (False, "max_bytes"),  # the vLLM worker's byte path: the most its blocks can take
])
def test_a_part_claiming_more_than_the_engine_expects_is_refused_before_it_is_read(
        tmp_path: Path, sealed: bool, expects: str) -> None:
    """The engine says what it expects of a part, with no buffer of its own to bound it: a part
    whose table claims each layer 4 096 times larger (512 MiB) is refused on its header, counted
    as `refused_format`, quarantined, with no memory taken by the claim; a genuine part within
    the expectation loads exactly."""
    svc = helper_service(tmp_path / "store", Keyring(SecretKey(MATERIAL)) if sealed else None)
    try:
        (forged, genuine), (_, payload) = _saved(svc, 2)
        expectation = {"segments": SPECS} if expects == "segments" else {"max_bytes": len(payload)}
        path = _part_file(tmp_path / "store", forged)
        big = tuple(attrs.evolve(s, shape=(s.shape[0] * 4096, *s.shape[1:])) for s in decode_header(path.read_bytes()).segments)
        _forge(path, segments=big)
        with _peak_growth() as grew, _python_peak() as peak:
            assert svc.load_part(forged, 0, **expectation) is None
        assert svc.counters.refused == {"format": 1} and svc.counters.quarantined == 1
        assert grew[0] < 16 << 20 and peak[0] < 4 << 20, (grew[0], peak[0])
        part = svc.load_part(genuine, 0, **expectation)
        assert part is not None and bytes(part.payload) == payload
    finally:
        svc.close()


def test_a_helper_process_refuses_a_forged_claim_on_the_slice_it_was_given_and_keeps_serving(
        tmp_path: Path) -> None:
    """Reader processes size nothing by a header: the slice of the
    shared region the engine hands them bounds the payload. A forged 1 TiB claim read there is a
    `refused_format` miss, quarantined; the pool stays on and the next genuine part is read by
    a helper, exact."""
    svc = helper_service(tmp_path / "store", Keyring(SecretKey(MATERIAL)))
    region = SharedRegion(2 << 20)
    pool = HelperPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (Keyring(SecretKey(MATERIAL)),)), 1)
    svc.attach_readers(pool)
    try:
        (forged, genuine), (_, payload) = _saved(svc, 2)
        _forge(_part_file(tmp_path / "store", forged), segments=_one_segment(TIB))
        slot = region.view[: 1 << 20]
        assert svc.load_part(forged, 0, out=slot, region_offset=0) is None
        assert svc.counters.refused == {"format": 1} and svc.counters.quarantined == 1
        part = svc.load_part(genuine, 0, out=slot, region_offset=0)
        assert pool.running and pool.parts_read == 1
        assert part is not None and bytes(part.payload) == payload
    finally:
        svc.close()


# ---------------------------------------------------------------- galahad-format


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key"
    path.write_text(MATERIAL.hex() + "\n")
    path.chmod(0o600)
    return path


def test_verify_reports_every_genuine_part_and_each_forged_one_in_bounded_memory(
        tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sealed store of four entries, two of them forged: a sealed part claiming 1 TiB, and a part
    made plain (cipher 0, header checksum made again) claiming 1 TiB in 4 KiB frames (268 million
    frames). `verify` used to stop at the first with MemoryError (and a BufferError), and never
    reported the genuine parts. Now each forged part is one BAD line (its first frame fails),
    every genuine one is counted good, and the tool's Python allocations stay under 16 MiB."""
    monkeypatch.delenv("GALAHAD_KEY_FILE", raising=False)
    monkeypatch.delenv("GALAHAD_KEY_COMMAND", raising=False)
    root = tmp_path / "store"
    svc = helper_service(root, Keyring(SecretKey(MATERIAL)))
    try:
        keys, _ = _saved(svc, 4)
    finally:
        svc.close()
    sealed, plain = _part_file(root, keys[0]), _part_file(root, keys[2])
    _forge(sealed, segments=_one_segment(TIB))
    _forge(plain, segments=_one_segment(TIB), frame_size=4096, cipher_id=CipherId.XXH3, key_id=bytes(8))
    with _python_peak() as peak:
        code = main(["verify", "--key-file", str(key_file), str(root)])
    out = capsys.readouterr().out
    assert code == 1, out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 2 and any(str(sealed) in line and "(IntegrityError)" in line for line in bad), out
    assert any(str(plain) in line and "frame 0 checksum" in line for line in bad), out
    assert "4 part file(s) checked: 2 good, 2 bad, 0 not checked, 0 unsealed" in out
    assert peak[0] < 16 << 20, peak[0]
    assert main(["verify", "--json", "--key-file", str(key_file), str(root)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["good"] == 2 and {b["file"] for b in report["bad"]} == {str(sealed), str(plain)}


def test_dump_json_of_a_forged_many_frame_file_streams_its_frame_table_in_bounded_memory(tmp_path: Path) -> None:
    """`dump --json` of a part forged to claim 1 GiB in 4 KiB frames (262 144 frames; the same
    with 268 million used to take 20 GB) builds no frame list: its Python allocations stay under
    16 MiB while it writes every frame, and what it writes is the whole table, in valid JSON.
    `dump --verify` of it stops at its first frame."""
    svc = helper_service(tmp_path / "store")
    try:
        (key,), _ = _saved(svc)
    finally:
        svc.close()
    path = _part_file(tmp_path / "store", key)
    forged = _forge(path, segments=_one_segment(1 << 30), frame_size=4096)
    written = tmp_path / "dump.json"
    with open(written, "w") as sink, contextlib.redirect_stdout(sink), _python_peak() as peak:
        t0 = time.perf_counter()
        code = main(["dump", "--json", str(path)])
        elapsed = time.perf_counter() - t0
    assert code == 0 and peak[0] < 16 << 20 and elapsed < 60, (peak[0], elapsed)
    (entry,) = json.loads(written.read_text())
    frames = entry["header"]["frames"]
    assert entry["header"]["frame_count"] == len(frames) == 1 << 18
    assert frames[-1] == {"index": (1 << 18) - 1, "plain_offset": (1 << 30) - 4096, "plain_len": 4096,
                          "data_offset": forged.header_len + (1 << 30) - 4096,
                          "tag_offset": forged.header_len + (1 << 30) + 16 * ((1 << 18) - 1)}
    with open(written, "w") as sink, contextlib.redirect_stdout(sink), _python_peak() as peak:
        t0 = time.perf_counter()
        code = main(["dump", "--verify", "--json", str(path)])
        elapsed = time.perf_counter() - t0
    (entry,) = json.loads(written.read_text())
    assert code == 1 and entry["error"]["class"] == "IntegrityError" and "frame 0" in entry["error"]["message"]
    assert peak[0] < 16 << 20, peak[0]
