"""Saves sealed and written by helper processes (`ReaderPool.write_part`, `GALAHAD_SAVE_PROCESSES`)
over the real filesystem store.

Real processes, real descriptors passed over a Unix socket, real shared memory: the payload lies
in the shared region (on the GPU, the pinned buffer the blocks were gathered into), the engine
process makes the temp file and hands its descriptor over, the helper seals and writes it, and the
store then fsyncs and places it as for any save. What a helper wrote loads in this process byte
for byte, plain and sealed; a killed helper turns the pool off once and the saves are written
here; a helper that cannot seal falls back here too; a disk error in a helper is the store's
error, as in process. (The CUDA side, the save buffers in a pinned shared region, is in
tests/gpu/test_save_region.py.)"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from galahad.adapters.crypto.key import Keyring
from galahad.bootstrap import open_cache, read_settings
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.reader_pool import HelperRecipe, ReaderPool, SharedRegion
from galahad.service import KVCacheService, SegmentSpec
from helpers.services import helper_service
from vllm_support.licence import make_licence

BLOCK, LAYERS = 16, 4
SHAPE = (4, 2, BLOCK, 64)  # float32: 32 KiB per layer, 128 KiB per entry
NBYTES = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
SLOT = 1 << 20


def _service(root: Path, keyring: Keyring | None = None) -> KVCacheService:
    return helper_service(root, keyring, "savers")


def _writers(svc: KVCacheService, keyring: Keyring | None = None, processes: int = 2) -> ReaderPool:
    pool = ReaderPool(SharedRegion(4 * SLOT), HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)),
                      processes, writes=True)
    svc.attach_writers(pool)
    return pool


def _save(svc: KVCacheService, pool: ReaderPool, n: int) -> tuple[list[ChainKey], list[list[bytes]]]:
    """n entries saved with their payload in the region (slot i % 4), as the CUDA path does."""
    keys = svc.keys(list(range(n * 64 + 1)), svc.seed())
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
    entries, payloads = [], []
    for i in range(n):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        payload = [os.urandom(NBYTES) for _ in range(LAYERS)]
        at = (i % 4) * SLOT
        pool.region.view[at : at + LAYERS * NBYTES] = b"".join(payload)
        views = [pool.region.view[at + j * NBYTES : at + (j + 1) * NBYTES] for j in range(LAYERS)]
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segments, views, region_offset=at)
        assert svc.commit(key)
        entries.append(key)
        payloads.append(payload)
    return entries, payloads


def _loads_back(svc: KVCacheService, entries: list[ChainKey], payloads: list[list[bytes]]) -> None:
    for key, payload in zip(entries, payloads):
        part = svc.load_part(key, 0)  # read and verified in this process
        assert part is not None
        assert [bytes(v) for v in part.segment_views()] == payload


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.p0.blk"))


def test_a_helper_process_seals_and_writes_parts_that_load_here_byte_for_byte(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    pool = _writers(svc)
    assert len(set(pool.pids()) | {os.getpid()}) == 3  # two helpers, neither of them this process
    entries, payloads = _save(svc, pool, 6)
    assert pool.parts_written == 6  # every part was written by a helper, none in this process
    _loads_back(svc, entries, payloads)
    files = _files(tmp_path / "store")
    assert len(files) == 6 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert svc.counters.saves == 6 and svc.counters.saves_skipped == 0
    assert svc.counters.bytes_saved == sum(f.stat().st_size for f in files)
    assert not [p for p in (tmp_path / "store").rglob("*") if p.name.startswith(".tmp")]  # no temp left
    svc.close()
    assert not pool.running


def test_saves_from_many_threads_each_land_with_their_own_bytes(tmp_path: Path) -> None:
    """As the worker's save threads do: 8 threads at once, each writing from its own slot of the
    region and filling it again once its last part was written, over 2 helpers. Every part loads
    back with the bytes its thread put there: no reply, descriptor or slot crossed to another."""
    svc = _service(tmp_path / "store")
    pool = ReaderPool(SharedRegion(8 * SLOT), HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)),
                      2, writes=True)
    svc.attach_writers(pool)
    keys = svc.keys(list(range(8 * 6 * 64 + 1)), svc.seed())
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]

    def saver(t: int) -> list[tuple[ChainKey, list[bytes]]]:
        out = []
        at = t * SLOT
        for i in range(6):
            n = t * 6 + i
            key = keys[svc.chunking.key_index(64 * (n + 1))]
            payload = [os.urandom(NBYTES) for _ in range(LAYERS)]
            pool.region.view[at : at + LAYERS * NBYTES] = b"".join(payload)
            views = [pool.region.view[at + j * NBYTES : at + (j + 1) * NBYTES] for j in range(LAYERS)]
            assert svc.save_part(key, Span(64 * n, 64 * (n + 1)), 0, segments, views, region_offset=at)
            assert svc.commit(key)
            out.append((key, payload))
        return out

    with ThreadPoolExecutor(8) as threads:
        saved = [pair for part in threads.map(saver, range(8)) for pair in part]
    assert pool.running and pool.parts_written == 48
    _loads_back(svc, [k for k, _ in saved], [p for _, p in saved])
    assert svc.counters.saves == 48 and svc.counters.saves_skipped == 0
    svc.close()


def test_sealed_parts_written_by_helpers_open_here_and_nowhere_else(tmp_path: Path) -> None:
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = _service(tmp_path / "store", keyring)
    pool = _writers(svc, keyring)
    entries, payloads = _save(svc, pool, 3)
    assert pool.parts_written == 3
    _loads_back(svc, entries, payloads)
    raw = _files(tmp_path / "store")[0].read_bytes()
    assert all(p[:4096] not in raw for payload in payloads for p in payload)  # encrypted at rest
    svc.close()
    stranger = _service(tmp_path / "store", Keyring(SecretKey(os.urandom(32))))
    assert stranger.load_part(entries[0], 0) is None and stranger.counters.refused == {"key": 1}
    stranger.close()


def test_a_killed_helper_turns_the_pool_off_once_and_saves_are_written_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path / "store")
    pool = _writers(svc, processes=1)
    (pid,) = pool.pids()
    os.kill(pid, 9)
    with caplog.at_level(logging.WARNING, logger="galahad.reader_pool"):
        entries, payloads = _save(svc, pool, 3)
    assert not pool.running and pool.parts_written == 0
    offs = [r.getMessage() for r in caplog.records if "OFF" in r.getMessage()]
    assert len(offs) == 1 and offs[0].startswith("[galahad] save processes OFF")
    assert offs[0].endswith("parts are written in this process from now on")
    _loads_back(svc, entries, payloads)
    assert svc.counters.saves == 3 and svc.counters.saves_skipped == 0
    assert len(_files(tmp_path / "store")) == 3
    assert not [p for p in (tmp_path / "store").rglob("*") if p.name.startswith(".tmp")]
    svc.close()


def test_a_helper_without_the_key_leaves_the_save_to_this_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Helpers built with another key cannot seal for this one: the part is sealed here, once
    said, and the pool stays on (the helper answered; it did not die)."""
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = _service(tmp_path / "store", keyring)
    pool = _writers(svc, Keyring(SecretKey(os.urandom(32))))
    with caplog.at_level(logging.WARNING, logger="galahad.service"):
        entries, payloads = _save(svc, pool, 2)
    assert pool.parts_written == 0 and pool.running
    assert len([r for r in caplog.records if "a save process could not write a part" in r.getMessage()]) == 1
    _loads_back(svc, entries, payloads)
    svc.close()


def test_a_disk_error_in_a_helper_is_the_stores_error(tmp_path: Path) -> None:
    """A write the disk refuses (here: a descriptor open read-only) comes back as
    `StoreUnavailable`, which the service counts as a skipped save, as for a write in process."""
    svc = _service(tmp_path / "store")
    pool = _writers(svc, processes=1)
    header = svc._header(svc.keys(list(range(65)), svc.seed())[0], Span(0, 64), 0,  # noqa: SLF001
                         [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)],
                         [b""] * LAYERS)
    target = tmp_path / "readonly"
    target.write_bytes(b"")
    fd = os.open(target, os.O_RDONLY)
    try:
        with pytest.raises(StoreUnavailable, match="could not write a part"):
            pool.write_part(fd, header, 0, LAYERS * NBYTES, Xxh3FrameCheck())
    finally:
        os.close(fd)
    assert pool.running  # the helper answered
    with pytest.raises(ValueError, match="not inside"):
        pool.write_part(0, header, 4 * SLOT - 10, LAYERS * NBYTES, Xxh3FrameCheck())
    svc.close()


def test_without_a_region_offset_the_save_stays_in_this_process(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    pool = _writers(svc)
    key = svc.keys(list(range(65)), svc.seed())[0]
    payload = [os.urandom(NBYTES) for _ in range(LAYERS)]
    assert svc.save_part(key, Span(0, 64), 0, [SegmentSpec(0, j, 0, "float32", SHAPE) for j in range(LAYERS)],
                         payload)
    assert svc.commit(key)
    assert pool.parts_written == 0
    _loads_back(svc, [key], [payload])
    svc.close()


def test_the_setting_reaches_the_service_that_the_engine_adapter_starts_them_from(tmp_path: Path) -> None:
    """`GALAHAD_SAVE_PROCESSES` read through `open_cache` as an engine adapter opens the cache
    (the vLLM worker starts that many over its pinned save region: tests/gpu). The helpers it
    would start build their ciphers from the service's recipe: a save they write opens here."""
    lic, pub = make_licence(tmp_path / "lic")
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
           "GALAHAD_LICENCE_ISSUER_KEY": pub, "GALAHAD_KEY_FILE": str(tmp_path / "store.key")}
    ns = Namespace(model="savers", model_fingerprint="savers", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=PayloadOrder.CHUNK)
    for extra, want in (({}, 0), ({"GALAHAD_SAVE_PROCESSES": "3"}, 3)):
        handle = open_cache(read_settings({**env, **extra}), ns, RankLayout())
        svc = handle.service
        assert svc is not None, handle.reason
        assert svc.save_processes == want
        if want:
            assert svc.helper_recipe is not None
            pool = ReaderPool(SharedRegion(4 * SLOT), svc.helper_recipe, 1, writes=True)
            svc.attach_writers(pool)
            entries, payloads = _save(svc, pool, 2)
            assert pool.parts_written == 2
            _loads_back(svc, entries, payloads)
        svc.close()


def test_a_write_the_disk_refuses_in_a_helper_is_a_skipped_save_and_leaves_nothing(tmp_path: Path) -> None:
    """The helpers start under a file size limit the parts exceed (RLIMIT_FSIZE, inherited at
    their start; this process's own limit is put back at once): each write fails there with
    EFBIG, as a full disk would fail it. The save is skipped and counted, nothing is stored or
    left half-written, and the pool stays on."""
    import resource

    svc = _service(tmp_path / "store")
    region = SharedRegion(4 * SLOT)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        pool = ReaderPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 1, writes=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    svc.attach_writers(pool)
    key = svc.keys(list(range(65)), svc.seed())[0]
    pool.region.view[: LAYERS * NBYTES] = os.urandom(LAYERS * NBYTES)
    views = [pool.region.view[j * NBYTES : (j + 1) * NBYTES] for j in range(LAYERS)]
    segments = [SegmentSpec(0, j, 0, "float32", SHAPE) for j in range(LAYERS)]
    assert not svc.save_part(key, Span(0, 64), 0, segments, views, region_offset=0)
    assert svc.counters.saves == 0 and svc.counters.saves_skipped == 1
    assert pool.running and pool.parts_written == 0
    assert not svc.store.has_part(key, 0)
    assert not [p for p in (tmp_path / "store").rglob("*") if p.name.startswith(".tmp")]
    svc.close()
