"""Loads read by helper processes (`galahad.adapters.helpers.pool`) over the real filesystem store.

Real processes, real descriptors passed over a Unix socket, real shared memory: the helper
reads the part into the shared region and verifies it there. The same bytes, the same refusals
(a damaged frame quarantines, a foreign key is a miss) and the same counters as a load read in
this process; a killed helper turns the pool off and the load is read here instead; helpers go
away with the process that started them. (The CUDA side, the region pinned for the GPU, is in
tests/gpu/test_reader_region.py.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID
from galahad.adapters.crypto.key import Keyring
from galahad.bootstrap import helper_ciphers, reader_processes_for
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.adapters.helpers.pool import HelperLost, HelperRecipe, HelperPool, SharedRegion
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import helper_service

BLOCK, LAYERS, ROWS = 16, 4, 4
SHAPE = (ROWS, 2, BLOCK, 64)  # float32: 32 KiB per layer, 128 KiB per entry
SLOT = 1 << 20


def _service(root: Path, keyring: Keyring | None = None) -> KVCacheService:
    return helper_service(root, keyring, "helpers")


def _saved(svc: KVCacheService, n: int) -> tuple[list[ChainKey], list[list[bytes]]]:
    keys = svc.keys(list(range(n * 64 + 1)), svc.seed())
    entries, payloads = [], []
    nbytes = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    for i in range(n):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        payload = [os.urandom(nbytes) for _ in range(LAYERS)]
        segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segments, payload)
        assert svc.commit(key)
        entries.append(key)
        payloads.append(payload)
    return entries, payloads


def _pool(svc: KVCacheService, keyring: Keyring | None = None, processes: int = 2) -> HelperPool:
    region = SharedRegion(4 * SLOT)
    pool = HelperPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)), processes)
    svc.attach_readers(pool)
    return pool


def _load(svc: KVCacheService, pool: HelperPool, key: ChainKey, slot: int = 0):
    at = slot * SLOT
    return svc.load_part(key, 0, out=pool.region.view[at : at + SLOT], region_offset=at)


def _part_file(root: Path, key: ChainKey) -> Path:
    (found,) = root.rglob(f"{key.hex}.p0.blk")
    return found


def test_a_helper_process_reads_and_verifies_the_same_bytes(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    entries, payloads = _saved(svc, 6)
    pool = _pool(svc)
    assert len(set(pool.pids()) | {os.getpid()}) == 3  # two helpers, neither of them this process
    for slot, (key, payload) in enumerate(zip(entries, payloads)):
        part = _load(svc, pool, key, slot % 4)
        assert part is not None
        assert [bytes(v) for v in part.segment_views()] == payload
    assert pool.parts_read == 6  # every part was read by a helper, none in this process
    assert svc.counters.bytes_loaded == sum(_part_file(tmp_path / "store", k).stat().st_size for k in entries)
    svc.close()
    assert not pool.running


def test_headers_come_back_whole_and_each_segment_table_crosses_once_per_helper(tmp_path: Path) -> None:
    """A helper sends a part's segment table by number after the first time (`_compact`): the
    header the engine process gets is still the one the same part gives read in process, for
    parts of two shapes through one helper, and each table crossed once."""
    svc = _service(tmp_path / "store")
    keys = svc.keys(list(range(8 * 64 + 1)), svc.seed())
    shapes = [SHAPE, (ROWS, 2, BLOCK, 32), SHAPE, (ROWS, 2, BLOCK, 32), SHAPE]
    saved = []
    for i, shape in enumerate(shapes):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        nbytes = 4 * shape[0] * shape[1] * shape[2] * shape[3]
        payload = [os.urandom(nbytes) for _ in range(LAYERS)]
        segments = [SegmentSpec(0, layer, 0, "float32", shape) for layer in range(LAYERS)]
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segments, payload) and svc.commit(key)
        saved.append((key, payload))
    here = [svc.load_part(key, 0) for key, _ in saved]  # no pool attached yet: read in process
    pool = _pool(svc, processes=1)
    for (key, payload), mine in zip(saved, here):
        part = _load(svc, pool, key)
        assert part is not None and mine is not None
        assert part.header == mine.header
        assert [bytes(v) for v in part.segment_views()] == payload
    assert pool.parts_read == len(saved)
    (helper,) = pool._helpers
    assert sorted(len(t) for t in helper.segments.values()) == [LAYERS, LAYERS]  # two tables, sent once each
    svc.close()


def test_a_reply_naming_a_segment_table_never_sent_turns_the_pool_off_and_the_load_is_read_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The engine process's record of a helper's tables is wiped after the first read, so the
    helper's next reply names a table it does not know: that is an answer it cannot trust, never
    a header it guesses; the pool stops, logged once, and the part is read in this process."""
    svc = _service(tmp_path / "store")
    entries, payloads = _saved(svc, 2)
    pool = _pool(svc, processes=1)
    assert _load(svc, pool, entries[0]) is not None
    (helper,) = pool._helpers
    helper.segments.clear()
    with caplog.at_level(logging.WARNING, logger="galahad.adapters.helpers.pool"):
        part = _load(svc, pool, entries[1], slot=1)
    assert part is not None and [bytes(v) for v in part.segment_views()] == payloads[1]
    assert not pool.running and pool.parts_read == 1
    offs = [r.getMessage() for r in caplog.records if "OFF" in r.getMessage()]
    assert len(offs) == 1 and offs[0].startswith("[galahad] reader processes OFF: a reader process answered ('nonsense'")
    assert svc.counters.refused == {} and svc.is_committed(entries[1])
    svc.close()


def test_a_damaged_part_read_by_a_helper_is_refused_quarantined_and_wiped(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    entries, _ = _saved(svc, 2)
    path = _part_file(tmp_path / "store", entries[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the payload
    path.write_bytes(bytes(data))
    pool = _pool(svc)
    assert _load(svc, pool, entries[0]) is not None
    pool.region.view[SLOT : 2 * SLOT] = b"\x01" * SLOT
    assert _load(svc, pool, entries[1], slot=1) is None
    assert svc.counters.refused == {"damaged": 1}
    assert svc.counters.quarantined == 1
    assert not svc.is_committed(entries[1])
    nbytes = LAYERS * 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    assert bytes(pool.region.view[SLOT : SLOT + nbytes]) == bytes(nbytes)  # unverified bytes never stay
    assert pool.running  # a refusal is an answer, not a lost helper
    svc.close()


def test_sealed_parts_open_in_helpers_and_a_foreign_key_is_a_miss_not_a_quarantine(tmp_path: Path) -> None:
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = _service(tmp_path / "store", keyring)
    entries, payloads = _saved(svc, 3)
    pool = _pool(svc, keyring)
    part = _load(svc, pool, entries[0])
    assert part is not None and [bytes(v) for v in part.segment_views()] == payloads[0]
    assert pool.parts_read == 1
    svc.attach_readers(None)
    stranger = _pool(svc, Keyring(SecretKey(os.urandom(32))))  # helpers holding another key
    assert _load(svc, stranger, entries[1]) is None
    assert svc.counters.refused == {"key": 1}
    assert svc.counters.quarantined == 0 and svc.is_committed(entries[1])
    svc.close()


def test_a_killed_helper_turns_the_pool_off_once_and_the_load_is_read_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path / "store")
    entries, payloads = _saved(svc, 3)
    pool = _pool(svc, processes=1)
    (pid,) = pool.pids()
    os.kill(pid, 9)
    with caplog.at_level(logging.WARNING, logger="galahad.adapters.helpers.pool"):
        for key, payload in zip(entries, payloads):
            part = _load(svc, pool, key)
            assert part is not None and [bytes(v) for v in part.segment_views()] == payload
    assert not pool.running and pool.parts_read == 0
    offs = [r for r in caplog.records if "reader processes OFF" in r.getMessage()]
    assert len(offs) == 1
    assert svc.counters.refused == {} and svc.counters.quarantined == 0
    svc.close()


def test_helpers_go_away_when_the_process_that_started_them_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys, time
        from galahad.adapters.helpers.pool import HelperRecipe, HelperPool, SharedRegion
        pool = HelperPool(SharedRegion(1 << 20), HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 2)
        print(*pool.pids(), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    parent.kill()  # kill -9: no cleanup code runs
    parent.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_the_helper_ciphers_match_the_engine_process_ciphers() -> None:
    keyring = Keyring(SecretKey(bytes(range(32))))
    lookup = helper_ciphers(keyring)
    key_id = keyring.current().key_id
    assert lookup(AES_GCM_CIPHER_ID, key_id) is not None
    assert lookup(AES_GCM_CIPHER_ID, b"\x00" * 8) is None
    plain = helper_ciphers(None)
    check = Xxh3FrameCheck()
    assert plain(check.cipher_id, check.key_id) is not None


def test_helpers_start_only_on_many_cores() -> None:
    assert [reader_processes_for(c) for c in (1, 2, 4, 7, 8, 15, 16, 20, 64)] == [0, 0, 0, 0, 4, 7, 12, 12, 12]
    # each tensor parallel worker starts its own: the cores are shared between them
    assert [reader_processes_for(32, r) for r in (1, 2, 4, 8)] == [12, 12, 4, 0]


def test_a_hung_helper_is_given_up_after_the_reply_timeout_and_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import galahad.adapters.helpers.pool as helper_pool

    monkeypatch.setattr(helper_pool, "_REPLY_TIMEOUT_S", 1.0)
    svc = _service(tmp_path / "store")
    entries, payloads = _saved(svc, 2)
    pool = _pool(svc, processes=1)
    (pid,) = pool.pids()
    os.kill(pid, 19)  # SIGSTOP: alive, never answers (a read stuck on a dead disk)
    t0 = time.monotonic()
    part = _load(svc, pool, entries[0])
    assert part is not None and [bytes(v) for v in part.segment_views()] == payloads[0]
    assert time.monotonic() - t0 < 10  # the reply timeout, then the kill; read here instead
    assert not pool.running and not _alive(pid)  # killed: it can never write into the region later
    svc.close()


def test_callers_waiting_for_a_helper_do_not_wait_for_ever_once_the_pool_is_off(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    svc = _service(tmp_path / "store")
    entries, payloads = _saved(svc, 4)
    pool = _pool(svc, processes=1)
    os.kill(pool.pids()[0], 9)
    with ThreadPoolExecutor(4) as ex:  # four loads at once, one helper (dead): all read here
        parts = list(ex.map(lambda i: _load(svc, pool, entries[i], slot=i), range(4), timeout=30))
    assert [[bytes(v) for v in p.segment_views()] for p in parts] == payloads
    assert not pool.running
    svc.close()


def test_a_helper_that_cannot_build_its_ciphers_stops_the_pool_naming_why(tmp_path: Path) -> None:
    from galahad.adapters.helpers.pool import HelperLost

    with pytest.raises(HelperLost, match="did not start: ModuleNotFoundError: No module named 'galahad.nowhere'"):
        HelperPool(SharedRegion(1 << 20), HelperRecipe("galahad.nowhere", "ciphers"), 2)


def test_a_python_that_cannot_be_started_is_an_error_at_start_not_a_hang(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(OSError):
        HelperPool(SharedRegion(1 << 20), HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 2)


def test_a_forked_child_lets_go_of_the_helpers(tmp_path: Path) -> None:
    pool = HelperPool(SharedRegion(1 << 20), HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 1)
    pid = os.fork()
    if pid == 0:  # the child: the pool is off and holds no socket of the helpers
        os._exit(0 if not pool.running and not pool._helpers else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.running  # the parent's pool is untouched
    pool.close()


def test_helpers_running_another_copy_of_galahad_are_refused_naming_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper imports the package from its own `sys.path`. Where that finds another copy (an
    older install beside this checkout), it would read or write parts with that copy's format
    code: the pool does not start, naming both folders, and the caller reads in process."""
    import shutil

    import galahad

    here = Path(galahad.__file__).resolve().parent
    other = tmp_path / "other"
    shutil.copytree(here, other / "galahad", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", str(other))  # the helpers find the copy first
    with pytest.raises(HelperLost, match="did not start: it runs the Galahad code in .*other/galahad, "
                                         f"this process the one in {here}"):
        HelperPool(SharedRegion(1 << 20), HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 1)
