"""Reading ahead at startup (`GALAHAD_PRELOAD_BYTES`): a restarted worker reads this rank's parts
of the store's most recently used entries into memory while the engine finishes starting, and
the first requests load them with no read of the disk.

- a real vLLM (CPU build) restart: the prompt saved by one process, loaded by the next from what
  it read ahead (counted `preloaded_loads`, token-identical), and with the setting off read from
  the disk as always (the check that the first can fail);
- the worker alone (real service, real filesystem store reopened as after a restart, real KV
  tensors; CPU, and marked `gpu` the CUDA path with its pinned arena): byte-exact in the blocks
  with the part files deleted after the read-ahead, the newest entries first within the budget,
  a damaged part refused and quarantined at the read-ahead as at any load, and parts nobody
  asked for given back.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

import torch  # noqa: E402

from galahad.adapters.cuda.pinned import PinnedPool  # noqa: E402
from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, LoadJob  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.format.codec import cipher_lookup  # noqa: E402
from galahad.domain.chain import ChainKey  # noqa: E402
from galahad.domain.chunking import Chunking  # noqa: E402
from galahad.domain.namespace import PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.app.service import KVCacheService  # noqa: E402
from vllm_support.harness import GalahadEnv, flip_bytes, kv_config, run_offline  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

import test_vllm_worker_reads as reads  # noqa: E402
from test_vllm_worker_reads import stack  # noqa: E402,F401 - the fixture: entries saved and committed

pytestmark = pytest.mark.vllm

PROMPT = prompt_ids(700, 41)


@pytest.fixture(scope="module")
def model() -> str:
    return build_model()


def _serve(model: str, env: GalahadEnv, name: str, **settings: str) -> dict[str, Any]:
    return run_offline(model, [[{"ids": PROMPT, "max_tokens": 16}]], env, kv=kv_config(),
                       llm={"enable_prefix_caching": False}, name=name, extra_env=settings)


def test_a_restarted_server_loads_what_it_read_ahead(model: str, tmp_path: Path) -> None:
    first = _serve(model, GalahadEnv(tmp_path / "w"), "writer")
    assert first["counters"][0]["committed"] >= 1
    shared = {"GALAHAD_CACHE_DIR": str(tmp_path / "w" / "store"),
              "GALAHAD_KEY_FILE": str(tmp_path / "w" / "store.key")}
    with ThreadPoolExecutor(2) as pool:
        on = pool.submit(_serve, model, GalahadEnv(tmp_path / "on", **shared), "on", GALAHAD_PRELOAD_BYTES="256M")
        off = pool.submit(_serve, model, GalahadEnv(tmp_path / "off", **shared), "off", GALAHAD_PRELOAD_BYTES="0")
        on_run, off_run = on.result(), off.result()
    answer = first["phases"][0][0]["token_ids"]
    assert on_run["phases"][0][0]["token_ids"] == answer == off_run["phases"][0][0]["token_ids"]
    counters = on_run["counters"][0]
    assert counters["hits_disk"] == 1 and counters["loads"] == 1 and counters["load_failures"] == 0
    assert counters["preloaded"] >= 1 and counters["preloaded_loads"] == 1
    assert "read ahead 1 of the store's most recently used entries" in on_run["log"]
    # the setting off: the same hit, read from the disk at the request
    off_counters = off_run["counters"][0]
    assert off_counters["hits_disk"] == 1 and off_counters["loads"] == 1
    assert off_counters.get("preloaded", 0) == 0 and off_counters.get("preloaded_loads", 0) == 0
    assert "read ahead" not in off_run["log"]


# ---------------------------------------------------------------- the worker alone


def _restarted(svc: KVCacheService, root: Path) -> KVCacheService:
    """The same store opened again, as by a restarted server (its index from the scan at open)."""
    check = Xxh3FrameCheck()
    store = FilesystemBlockStore(root, svc.namespace, rescan_s=None)
    return KVCacheService(namespace=svc.namespace, store=store, chunking=Chunking(PayloadOrder.CHUNK, reads.BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))


def _started(svc: KVCacheService, device: str, budget: int) -> tuple[GalahadWorker, dict[str, torch.Tensor]]:
    dest = reads._caches(device, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), reads._config(), reads.BLOCK, preload_bytes=budget)
    worker.register(dest)
    deadline = time.monotonic() + 30
    while not worker.read_ahead.until and time.monotonic() < deadline:  # the read-ahead thread is done
        time.sleep(0.01)
    assert worker.read_ahead.until, "the read-ahead did not finish"
    return worker, dest


def _load(worker: GalahadWorker, entries: list[EntryRef], device: str) -> tuple[Any, set[int]]:
    """Block b of the saved entries into block b + 48."""
    shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in entries]
    meta = GalahadMetadata()
    meta.loads.append(LoadJob("r", tuple(shifted), False, len(entries) * 64))
    worker.start_load(meta)
    if device == "cuda":
        torch.cuda.synchronize()
    return worker.take_report(), worker.take_invalid_blocks()


def _how_many(worker: GalahadWorker, entries: list[EntryRef], root: Path) -> int:
    """Entries the read-ahead has room for: on CUDA the pinned arena, each part taking at least
    4 MiB of it (one here), on the byte path all of them."""
    if worker.cuda is None:
        return len(entries)
    size = os.path.getsize(next(root.rglob("*.blk")))
    return min(len(entries), worker.read_ahead.arena_bytes // PinnedPool.footprint(size))


def test_a_restarted_worker_loads_what_it_read_ahead_with_the_files_gone(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    again = _restarted(svc, root)
    worker, dest = _started(again, device, 1 << 30)
    n = _how_many(worker, entries, Path(root))
    newest = entries[len(entries) - n :]  # saved last: the most recently used
    assert worker.read_ahead.keys() == {e.key for e in newest}
    assert again.snapshot_counters().preloaded == n
    for path in Path(root).rglob("*.blk"):  # nothing left to read at the request
        path.unlink()
    report, invalid = _load(worker, newest, device)
    assert report is not None and report.loaded["r"] == [(0, None)] and not invalid
    assert not report.timings  # a load from memory says nothing of the store's rate
    first = newest[0].start // reads.BLOCK
    for name in source:  # byte for byte what was saved
        assert torch.equal(dest[name][48 + first : 48 + first + 4 * n], source[name][first : first + 4 * n])
    counters = again.take_counters()
    assert counters.preloaded_loads == n and counters.load_failures == 0
    assert not worker.read_ahead  # each part read ahead serves one load, then its memory goes back
    again.store.close()


def test_with_nothing_read_ahead_the_same_load_misses_once_the_files_are_gone(stack) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    again = _restarted(svc, root)
    dest = reads._caches(device, fill=0.0)
    worker = GalahadWorker(again, 0, RankLayout(), reads._config(), reads.BLOCK, preload_bytes=0)
    worker.register(dest)
    assert not worker.read_ahead
    for path in Path(root).rglob("*.blk"):
        path.unlink()
    report, invalid = _load(worker, entries[-1:], device)
    assert report is not None and report.loaded["r"] == [(0, entries[-1].key)]
    assert invalid == set(range(48 + entries[-1].start // reads.BLOCK, 48 + entries[-1].end // reads.BLOCK))
    assert again.take_counters().preloaded_loads == 0
    again.store.close()


def test_the_budget_takes_the_newest_entries(stack) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    again = _restarted(svc, root)
    if device == "cuda":
        pytest.skip("the CUDA arena here holds one 4 MiB buffer: the budget test needs the byte path")
    size = os.path.getsize(next(Path(root).rglob("*.blk")))
    worker, _dest = _started(again, device, 3 * size)
    assert worker.read_ahead.keys() == {e.key for e in entries[-3:]}
    again.store.close()


def test_a_damaged_part_is_refused_at_the_read_ahead_and_quarantined(stack) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    bad = entries[-1]  # the newest: the first the read-ahead would take
    flip_bytes(next(p for p in Path(root).rglob(f"{bad.key.hex()}.p0.blk")), (0.5,))  # a payload byte
    again = _restarted(svc, root)
    worker, _dest = _started(again, device, 1 << 30)
    assert bad.key not in worker.read_ahead.keys()
    counters = again.snapshot_counters()
    assert counters.refused.get("damaged") == 1 and counters.quarantined == 1
    assert not again.store.is_committed(ChainKey(bad.key))
    report, invalid = _load(worker, [bad], device)  # never served: the entry is gone for every rank
    assert report is not None and report.loaded["r"] == [(0, bad.key)] and invalid
    again.store.close()


def test_parts_nobody_asked_for_go_back(stack) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    again = _restarted(svc, root)
    worker, _dest = _started(again, device, 1 << 30)
    assert worker.read_ahead
    released: list[object] = []
    if worker.cuda is not None:
        give_back = worker.cuda.pool.release
        worker.cuda.pool.release = lambda buf, ready=None: (released.append(buf), give_back(buf, ready))  # type: ignore[method-assign]
    worker.read_ahead.until = time.monotonic() - 1  # the keeping time is over
    report, _invalid = _load(worker, entries[:1], device)  # any step's loads check it
    assert not worker.read_ahead and again.take_counters().preloaded_loads == 0
    if worker.cuda is not None:
        assert released  # the arena's pieces are free again
    again.store.close()


def test_a_load_not_read_ahead_takes_the_arena_back_rather_than_pin(stack) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the parts read ahead hold the pinned arena; a load (or save) that finds no room
    gives them back, least recent first, rather than go without a pinned buffer (nothing is
    pinned on a request's path)."""
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    if device != "cuda":
        pytest.skip("the pinned arena is the CUDA path's")
    again = _restarted(svc, root)
    worker, dest = _started(again, device, 1 << 30)
    assert worker.cuda is not None and worker.read_ahead.keys() == {entries[-1].key}  # the arena is full
    busy = []  # every other free buffer taken (saves and loads in flight): only the arena is left
    while (buf := worker.cuda.pool.acquire(1, shared=None)) is not None:
        busy.append(buf)
    pinned = worker.cuda.pool.pinned_allocations
    report, invalid = _load(worker, entries[:1], device)  # an entry not read ahead
    assert report is not None and report.loaded["r"] == [(0, None)] and not invalid
    assert worker.cuda.pool.pinned_allocations == pinned  # nothing pinned on the engine's thread
    assert not worker.read_ahead  # the part read ahead gave its room back
    for name in source:
        assert torch.equal(dest[name][48:52], source[name][0:4])
    for buf in busy:
        worker.cuda.pool.release(buf)
    again.store.close()


def test_on_the_byte_path_the_read_ahead_takes_at_most_half_the_available_memory(
        stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    device = next(iter(source.values())).device.type
    if device != "cpu":
        pytest.skip("on CUDA the pinned arena bounds it")
    from galahad.adapters.vllm.worker import readahead

    size = os.path.getsize(next(Path(root).rglob("*.blk")))
    monkeypatch.setattr(readahead, "available_memory", lambda: 4 * size + 1)  # room for two parts
    again = _restarted(svc, root)
    with caplog.at_level("INFO", logger="galahad.adapters.vllm.worker"):
        worker, _dest = _started(again, device, 1 << 40)  # a terabyte asked for
    assert worker.read_ahead.keys() == {e.key for e in entries[-2:]}
    assert "more than half the memory available" in caplog.text
    again.store.close()
