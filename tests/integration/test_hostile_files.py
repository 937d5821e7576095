"""Files planted by someone who can write into the store folder get nowhere: a part is bound to its
file, its entry, its rank and its namespace, so moving, copying, swapping or re-signing genuine
bytes is refused (a miss, counted, set aside), never served; and no two files share a nonce.

Real stores on disk, real sealed (AES-256-GCM) and checksummed parts written by the service, real
bytes moved and forged by hand.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import xxhash

from galahad.adapters.crypto.key import Keyring
from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.secret import SecretKey
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import BLOCK, LAYERS, helper_service

SHAPE = (1, 2, BLOCK, 4)  # one float32 block of 2 x 16 x 4 per layer
PAYLOAD = 4 * 2 * BLOCK * 4
ROOTS: dict[int, Path] = {}  # the store folder of each service made here


def _service(root: Path, *, key: bytes | None = None, model: str = "hostile", tp: int = 1) -> KVCacheService:
    svc = helper_service(root, Keyring(SecretKey(key)) if key is not None else None, model=model, tp=tp)
    ROOTS[id(svc)] = root
    return svc


def _save(svc: KVCacheService, tokens: list[int], ranks: int = 1) -> tuple[ChainKey, list[list[bytes]]]:
    """Save the first 64-token chunk of `tokens` on every rank; the key and each rank's layers.
    Each part loads back whole before any test touches it (so a refusal after is the tampering's)."""
    key = svc.keys(tokens, svc.seed())[svc.chunking.key_index(64)]
    written = []
    for rank in range(ranks):
        layers = [os.urandom(PAYLOAD) for _ in range(LAYERS)]
        segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
        assert svc.save_part(key, Span(0, 64), rank, segments, layers)
        written.append(layers)
    assert svc.commit(key)
    for rank, layers in enumerate(written):
        loaded = svc.load_part(key, rank)
        assert loaded is not None and [bytes(v) for v in loaded.segment_views()] == layers
    return key, written


def _part(svc: KVCacheService, key: ChainKey, rank: int = 0) -> Path:
    """The file of `key`'s part `rank` in the service's store (ROOT/ns-<hex>/<k0:2>/<k2:4>/)."""
    store = svc.store
    assert isinstance(store, FilesystemBlockStore)
    found = list(Path(ROOTS[id(svc)]).rglob(f"{key.hex}.p{rank}.blk"))
    assert len(found) == 1, found
    return found[0]


def _refused(svc: KVCacheService, key: ChainKey, rank: int = 0) -> None:
    """The load is a miss, counted as a refusal; nothing of the part reaches the caller."""
    before = svc.counters.load_failures
    assert svc.load_part(key, rank) is None
    assert svc.counters.load_failures == before + 1, svc.counters.as_dict()


@pytest.fixture(params=["sealed", "plain"])
def key(request: pytest.FixtureRequest) -> bytes | None:
    return os.urandom(32) if request.param == "sealed" else None


def test_a_part_copied_under_another_entrys_name_is_refused(tmp_path: Path, key: bytes | None) -> None:
    svc = _service(tmp_path / "store", key=key)
    a, _ = _save(svc, list(range(100)))
    b, _ = _save(svc, list(range(1000, 1100)))
    assert _part(svc, a).stat().st_size == _part(svc, b).stat().st_size
    shutil.copyfile(_part(svc, a), _part(svc, b))
    _refused(svc, b)
    assert svc.load_part(a, 0) is not None  # the genuine one still loads


def test_a_part_moved_to_another_ranks_name_is_refused(tmp_path: Path, key: bytes | None) -> None:
    svc = _service(tmp_path / "store", key=key, tp=2)
    entry, _ = _save(svc, list(range(100)), ranks=2)
    p0, p1 = _part(svc, entry, 0), _part(svc, entry, 1)
    tmp = p0.with_suffix(".swap")
    os.replace(p0, tmp)
    os.replace(p1, p0)
    os.replace(tmp, p1)  # rank 0's file under rank 1's name and the reverse
    _refused(svc, entry, 0)
    _refused(svc, entry, 1)


def test_a_part_of_another_namespace_is_refused(tmp_path: Path, key: bytes | None) -> None:
    """Another model's part (same key bytes, same shapes) copied under this namespace's name."""
    here = _service(tmp_path / "store", key=key, model="model-a")
    there = _service(tmp_path / "other", key=key, model="model-b")
    entry, _ = _save(here, list(range(100)))
    foreign, _ = _save(there, list(range(100)))
    shutil.copyfile(_part(there, foreign), _part(here, entry))
    _refused(here, entry)


def test_frames_swapped_between_two_genuine_files_are_refused(tmp_path: Path, key: bytes | None) -> None:
    svc = _service(tmp_path / "store", key=key)
    a, _ = _save(svc, list(range(100)))
    b, _ = _save(svc, list(range(1000, 1100)))
    da, db = bytearray(_part(svc, a).read_bytes()), bytearray(_part(svc, b).read_bytes())
    half = len(da) // 2  # past the header: the second half of the payload's frames
    da[half:], db[half:] = db[half:], da[half:]
    _part(svc, a).write_bytes(bytes(da))
    _part(svc, b).write_bytes(bytes(db))
    _refused(svc, a)
    _refused(svc, b)


def test_a_plain_header_re_signed_for_another_entry_is_refused(tmp_path: Path) -> None:
    """The clear header's own checksum can be recomputed by anyone; the frames' checksums are bound
    to the header they were written under, so a header edited and re-signed still refuses."""
    svc = _service(tmp_path / "store")
    a, _ = _save(svc, list(range(100)))
    b, _ = _save(svc, list(range(1000, 1100)))
    data = bytearray(_part(svc, a).read_bytes())
    at = data.find(a.raw)
    assert at > 0  # the entry's key is in the clear header
    data[at:at + len(a.raw)] = b.raw
    header_len = int.from_bytes(data[20:24], "little")
    data[header_len - 16:header_len] = xxhash.xxh3_128_digest(bytes(data[:header_len - 16]))
    _part(svc, b).write_bytes(bytes(data))
    _refused(svc, b)


def test_no_two_sealed_files_share_a_nonce_across_processes_and_ranks(tmp_path: Path) -> None:
    """The same bytes saved under the same key by two servers (two service instances, as two
    processes) and by two ranks: every file's nonce and ciphertext differ."""
    key = os.urandom(32)
    layers = [bytes(PAYLOAD)] * LAYERS
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
    files = []
    for n in range(2):
        svc = _service(tmp_path / f"server{n}", key=key, tp=2)
        entry = svc.keys(list(range(100)), svc.seed())[svc.chunking.key_index(64)]
        for rank in range(2):
            assert svc.save_part(entry, Span(0, 64), rank, segments, layers)
            files.append(_part(svc, entry, rank).read_bytes())
    header_len = int.from_bytes(files[0][20:24], "little")
    payloads = {f[header_len:] for f in files}
    assert len(payloads) == len(files)  # four different ciphertexts of one plaintext
    for i, f in enumerate(files):
        for g in files[i + 1:]:
            same = sum(1 for x, y in zip(f[:header_len], g[:header_len]) if x != y)
            assert same >= 12  # at least a 96-bit nonce's worth of header bytes differ
