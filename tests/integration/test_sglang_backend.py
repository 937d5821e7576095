"""GalahadHiCacheStorage driven by SGLang 0.5.23's real classes: the storage factory's `dynamic`
path, its host memory pools built on the CPU, and HiCacheController's page functions.

A real SGLang server cannot run on these machines (research/sglang_hicache_api.md §7).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_support import harness
from sglang_support.fixtures import backends, galahad_settings, sgl  # noqa: F401 - fixtures

pytestmark = pytest.mark.sglang

DOCUMENTED = "Creating dynamic storage backend 'galahad' (galahad_vllm.sglang_backend.GalahadHiCacheStorage)"


def test_the_documented_dynamic_config_builds_our_backend(sgl: Any, galahad_settings: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from galahad_vllm.sglang_backend import GalahadHiCacheStorage

    pool = harness.make_pool("mha", "page_first")
    config = harness.storage_config()
    config.extra_config = {"backend_name": "galahad", "module_path": "galahad_vllm.sglang_backend",
                           "class_name": "GalahadHiCacheStorage"}  # verbatim from the product page
    with caplog.at_level(logging.INFO):
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
    try:
        assert isinstance(backend, GalahadHiCacheStorage)
        assert DOCUMENTED in caplog.text
        assert backend.enabled, backend.reason
        assert "[galahad] (sglang rank 0) caching ENABLED" in caplog.text
        assert "model fingerprint comes from the served name" in caplog.text  # no fingerprint given
    finally:
        backend.close()


def test_register_sglang_backend_lets_the_factory_build_it_by_name(sgl: Any, galahad_settings: Any) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from galahad_vllm.sglang_backend import GalahadHiCacheStorage, register_sglang_backend

    register_sglang_backend()
    register_sglang_backend()  # idempotent
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend", "galahad"])
    assert args.hicache_storage_backend == "galahad"  # the command line takes the name too
    pool = harness.make_pool("mla", "page_first")
    backend = StorageBackendFactory.create_backend("galahad", harness.storage_config(mla=True), pool)
    try:
        assert isinstance(backend, GalahadHiCacheStorage)
        # SGLang's own backends still build as before
        file_backend = StorageBackendFactory.create_backend(
            "file", harness.storage_config(extra={"file_storage_path": galahad_settings["GALAHAD_CACHE_DIR"] + "-f"}),
            pool)
        assert type(file_backend).__name__ == "HiCacheFile"
    finally:
        backend.close()


# A fresh process, as `python -m sglang.launch_server` starts: SGLang's general plugins first
# (`load_plugins()`, which every SGLang process runs, the scheduler's included), then its command
# line, then the factory building the backend named there.
_BY_NAME = """
import json
from sglang_support import load_sglang
load_sglang()  # with torchvision's stand-in on a CPU machine (sglang_support's docstring says why)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "m", "--enable-hierarchical-cache",
                            "--hicache-storage-backend", "galahad"])
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_support import harness
pool = harness.make_pool("mha", "page_first")
backend = StorageBackendFactory.create_backend(args.hicache_storage_backend, harness.storage_config(), pool)
backend.register_mem_pool_host(pool)
backend.on_host_pools_registered()
print(json.dumps({"name": args.hicache_storage_backend, "class": type(backend).__name__,
                  "enabled": backend.enabled, "reason": backend.reason}))
backend.close()
"""


def test_installed_galahad_is_an_sglang_plugin_so_the_command_line_takes_the_name_galahad(
        sgl: Any, galahad_settings: Any) -> None:
    """pyproject.toml's `sglang.srt.plugins` entry point: no code, no registration call."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("SGLANG_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", _BY_NAME], env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "name": "galahad", "class": "GalahadHiCacheStorage", "enabled": True, "reason": ""}
    # SGLang's allow list leaving Galahad's plugin out: the name is refused, as SGLang alone does
    env["SGLANG_PLUGINS"] = "another"
    run = subprocess.run([sys.executable, "-c", _BY_NAME], env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 2 and "invalid choice: 'galahad'" in run.stderr, run.stderr[-2000:]


def test_pages_written_before_a_restart_are_read_back_identical_in_a_new_process(
        sgl: Any, backends: Any, tmp_path: Path) -> None:
    import torch

    cases = []
    tokens = list(range(1000, 1000 + 6 * 16))
    for n, (kind, layout) in enumerate((k, lay) for k in ("mha", "mla") for lay in harness.LAYOUTS):
        pool = harness.make_pool(kind, layout)
        harness.fill_random(pool, seed=n)
        backend = backends(pool, mla=kind == "mla")
        keys = harness.page_keys([t + n for t in tokens], pool.page_size)
        indices = pool.alloc(len(keys) * pool.page_size)
        zero_copy = n % 2 == 0  # alternate the write interface; the reader uses the other one too
        assert harness.backup(harness.controller(backend, pool), keys, indices, zero_copy=zero_copy) == len(tokens)
        expected = tmp_path / f"{kind}-{layout}.pt"
        torch.save(harness.flat_pages(pool, indices, len(keys)), expected)
        cases.append({"name": f"{kind}/{layout}", "kind": kind, "layout": layout, "keys": keys,
                      "expected": str(expected), "interface": "legacy" if zero_copy else "v1"})
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "sglang_support.reader", str(spec)], env=env,
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-4000:]
    results = {r["case"]: r for r in map(json.loads, run.stdout.strip().splitlines())}
    assert sorted(results) == sorted(c["name"] for c in cases)
    for name, r in results.items():
        assert r["exists"] == [6, 2, 5], name  # whole chain; stops at the foreign key; a suffix
        assert r["pages_read"] == 6, name
        assert all(r["identical"]), name
        assert r["counters"]["errors"] == 0 and r["counters"]["store_load_failures"] == 0, name


def test_batch_exists_counts_only_the_leading_run_of_stored_pages(sgl: Any, backends: Any) -> None:
    pool = harness.make_pool("mha", "page_first_direct")
    harness.fill_random(pool, seed=7)
    backend = backends(pool)
    keys = harness.page_keys(list(range(8 * 16)), pool.page_size)
    stored = [0, 1, 2, 4, 5]
    indices = pool.alloc(len(stored) * pool.page_size)
    assert all(backend.batch_set_v1([keys[i] for i in stored], indices))
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:6]) == 2
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[5]) and not backend.exists(keys[6])


def test_copy_and_zero_copy_interfaces_read_each_others_pages(sgl: Any, backends: Any) -> None:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController

    for kind in ("mha", "mla"):
        pool = harness.make_pool(kind, "layer_first")
        harness.fill_random(pool, seed=11)
        backend = backends(pool, mla=kind == "mla")
        keys = harness.page_keys(list(range(3 * 16)), pool.page_size)
        src = pool.alloc(3 * pool.page_size)
        assert backend.batch_set(keys[:2], [pool.get_data_page(int(i), flat=True) for i in src[: 2 * 16 : 16]])
        assert backend.set(keys[2], pool.get_data_page(int(src[32]), flat=True))
        dst = pool.alloc(3 * pool.page_size)
        ctl = harness.controller(backend, pool)
        assert HiCacheController._page_get_zero_copy(ctl, harness.operation(), keys, dst) == 3
        assert all(torch.equal(a, b) for a, b in zip(harness.flat_pages(pool, src, 3), harness.flat_pages(pool, dst, 3)))
        target = pool.get_dummy_flat_data_page()
        assert torch.equal(backend.get(keys[1], target).view(torch.uint8), harness.flat_pages(pool, src, 2)[1])


def test_mla_rank_zero_writes_and_every_rank_reads_the_same_page(sgl: Any, backends: Any) -> None:
    import torch

    writer_pool = harness.make_pool("mla", "page_first")
    harness.fill_random(writer_pool, seed=3)
    writer = backends(writer_pool, mla=True, tp_rank=0, tp_size=2)
    reader_pool = harness.make_pool("mla", "page_first")
    reader = backends(reader_pool, mla=True, tp_rank=1, tp_size=2)
    keys = harness.page_keys(list(range(4 * 16)), 16)
    src = writer_pool.alloc(4 * 16)
    assert reader.batch_set_v1(keys, reader_pool.alloc(4 * 16)) == [False] * 4  # not a writer: nothing stored
    assert all(writer.batch_set_v1(keys, src))
    assert reader.batch_exists(keys) == 4 and writer.batch_exists(keys) == 4
    dst = reader_pool.alloc(4 * 16)
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(harness.flat_pages(writer_pool, src, 4), harness.flat_pages(reader_pool, dst, 4)))


def test_a_tp_entry_counts_only_when_every_rank_has_written_its_own_shard(sgl: Any, backends: Any) -> None:
    import torch

    pools = [harness.make_pool("mha", "page_first") for _ in range(2)]
    for rank, pool in enumerate(pools):
        harness.fill_random(pool, seed=100 + rank)
    ranks = [backends(pool, tp_rank=r, tp_size=2) for r, pool in enumerate(pools)]
    keys = harness.page_keys(list(range(2 * 16)), 16)
    src = [pool.alloc(2 * 16) for pool in pools]
    assert all(ranks[0].batch_set_v1(keys, src[0]))  # its part is durable ...
    assert ranks[0].batch_exists(keys) == 0 == ranks[1].batch_exists(keys)  # ... the entry is not
    assert all(ranks[1].batch_set_v1(keys, src[1]))
    assert ranks[0].batch_exists(keys) == 2 == ranks[1].batch_exists(keys)
    for rank, pool in enumerate(pools):  # each rank gets its own shard back, never the other's
        dst = pool.alloc(2 * 16)
        assert ranks[rank].batch_get_v1(keys, dst) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(harness.flat_pages(pool, src[rank], 2), harness.flat_pages(pool, dst, 2)))
    single = backends(harness.make_pool("mha", "page_first"))  # TP=1: another namespace
    assert single.batch_exists(keys) == 0


def test_a_page_written_under_another_model_fingerprint_is_never_returned(sgl: Any, backends: Any) -> None:
    pool = harness.make_pool("mha", "page_first")
    harness.fill_random(pool, seed=5)
    keys = harness.page_keys(list(range(2 * 16)), 16)
    writer = backends(pool, extra={"model_fingerprint": "weights-A"})
    assert all(writer.batch_set_v1(keys, pool.alloc(2 * 16)))
    other = backends(harness.make_pool("mha", "page_first"), extra={"model_fingerprint": "weights-B"})
    assert other.batch_exists(keys) == 0
    dst = other.mem_pool_host.alloc(2 * 16)
    assert other.batch_get_v1(keys, dst) == [False, False]
    assert all(not page.any() for page in harness.flat_pages(other.mem_pool_host, dst, 2))  # left untouched
    other_dtype = backends(harness.make_pool("mha", "page_first", dtype=__import__("torch").float16),
                           extra={"model_fingerprint": "weights-A"})
    assert other_dtype.batch_exists(keys) == 0
    other_layout = backends(harness.make_pool("mha", "page_first_direct"), extra={"model_fingerprint": "weights-A"})
    assert other_layout.batch_exists(keys) == 0
    same = backends(harness.make_pool("mha", "page_first"), extra={"model_fingerprint": "weights-A"})
    assert same.batch_exists(keys) == 2


def test_get_stats_gives_sglang_storage_metrics(sgl: Any, backends: Any) -> None:
    from sglang_support import load_sglang

    load_sglang()
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = harness.make_pool("mha", "page_first")
    backend = backends(pool)
    keys = harness.page_keys(list(range(3 * 16)), 16)
    assert all(backend.batch_set_v1(keys, pool.alloc(3 * 16)))
    assert backend.batch_get_v1(keys, pool.alloc(3 * 16)) == [True] * 3
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == []  # drained


def test_the_store_size_cap_evicts_least_recently_used_pages(sgl: Any, backends: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pool = harness.make_pool("mha", "page_first")
    page_bytes = 2 * 4 * 16 * 2 * 16 * 2
    monkeypatch.setenv("GALAHAD_MAX_BYTES", str(6 * (page_bytes + 4096)))
    backend = backends(pool)
    keys = harness.page_keys(list(range(20 * 16)), 16)
    for i in range(0, 20, 4):
        backend.batch_set_v1(keys[i : i + 4], pool.alloc(4 * 16))
    store = backend._service.store  # noqa: SLF001 - the size accounting under test
    assert store.used_bytes() <= store.max_bytes
    assert backend.batch_exists(keys[-2:]) == 2  # the newest are kept
    assert backend.batch_exists(keys[:1]) == 0  # the oldest made room
    assert backend.counters()["store_evicted"] >= 0


def test_clear_sets_aside_every_entry_of_the_namespace(sgl: Any, backends: Any) -> None:
    pool = harness.make_pool("mha", "page_first")
    backend = backends(pool)
    keys = harness.page_keys(list(range(3 * 16)), 16)
    assert all(backend.batch_set_v1(keys, pool.alloc(3 * 16)))
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


def test_the_model_folder_is_fingerprinted_when_no_fingerprint_is_given(sgl: Any, backends: Any,
                                                                        tmp_path: Path) -> None:
    folders = []
    for name, layers in (("a", 32), ("b", 40)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
        folders.append(str(folder))
    pool = harness.make_pool("mha", "page_first")
    keys = harness.page_keys(list(range(2 * 16)), 16)
    writer = backends(pool, model=folders[0], extra={"model_fingerprint": None})  # --model-path a folder
    assert all(writer.batch_set_v1(keys, pool.alloc(32)))
    same = backends(harness.make_pool("mha", "page_first"), model=folders[0], extra={"model_fingerprint": None})
    assert same.batch_exists(keys) == 2
    # one served name, two checkpoints: told apart by the folders' fingerprints
    served_a, served_b = ({"model_fingerprint": None, "model_path": f} for f in folders)
    first = backends(pool, model="served-name", extra=served_a)
    assert all(first.batch_set_v1(keys, pool.alloc(32)))
    assert backends(harness.make_pool("mha", "page_first"), model="served-name", extra=served_a).batch_exists(keys) == 2
    assert backends(harness.make_pool("mha", "page_first"), model="served-name", extra=served_b).batch_exists(keys) == 0


def test_each_sglang_call_counts_once_single_page_calls_included(sgl: Any, backends: Any) -> None:
    """`exists`, `get` and `set` went through the guarded batch methods and counted two calls
    each (and a failure inside them two errors)."""
    pool = harness.make_pool("mha", "page_first")
    backend = backends(pool)
    keys = harness.page_keys(list(range(2 * 16)), 16)
    page = pool.get_data_page(0, flat=True)
    calls = [lambda: backend.set(keys[0], page), lambda: backend.exists(keys[0]),
             lambda: backend.get(keys[0], pool.get_dummy_flat_data_page()), lambda: backend.batch_exists(keys),
             lambda: backend.set(keys[1], page[:8])]  # a page of the wrong size: one error
    for call in calls:
        before = backend.counters()
        call()
        after = backend.counters()
        assert after["calls"] - before["calls"] == 1
        assert after["errors"] - before["errors"] <= 1
    assert backend.counters()["errors"] == 1


def test_the_startup_and_shutdown_lines_are_the_documented_ones_in_order(
        sgl: Any, galahad_settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    """docs/sglang.md, What SGLang prints: each line's shape, in that order, then the closing totals."""
    import re

    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = harness.make_pool("mha", "page_first_direct")
    with caplog.at_level(logging.INFO):
        backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(), pool)
        backend.register_mem_pool_host(pool)
        backend.close()
    root = re.escape(galahad_settings["GALAHAD_CACHE_DIR"])
    documented = [
        re.escape(DOCUMENTED),
        r"\[galahad\] SGLang storage backend created \(tp 0/1, pp 0/1, sharded KV\)",
        r"\[galahad\] \(sglang rank 0\) licence OK: sglang-tests, 64 points, expires \d{4}-\d\d-\d\d",
        rf"\[galahad\] \(sglang rank 0\) store {root}",
        r"\[galahad\] \(sglang rank 0\) namespace [0-9a-f]{16} \(model test-org/Tiny-Galahad-7B, bfloat16, "
        r"block 16, tp 1 x pp 1, order layer\)",
        r"\[galahad\] \(sglang rank 0\) encryption ON: AES-256-GCM, key id [0-9a-f]{16} from "
        rf"GALAHAD_KEY_FILE={re.escape(galahad_settings['GALAHAD_KEY_FILE'])}",
        r"\[galahad\] \(sglang rank 0\) caching ENABLED \(.+\)",
        r"\[galahad\] SGLang backend ready: rank 0 of 1, sharded KV, page 16 tokens x 8192 bytes, "
        r"page_first_direct layout, call limit 5\.0 s",
        r"\[galahad\] SGLang backend closed: \{'calls': 0, .*'enabled': True, .*\}",  # as it was while open
    ]
    lines = [r.getMessage() for r in caplog.records]
    at = 0
    for pattern in documented:
        found = next((i for i in range(at, len(lines)) if re.fullmatch(pattern, lines[i])), None)
        assert found is not None, f"{pattern!r} not found after line {at}:\n" + "\n".join(lines)
        at = found + 1


def test_tp_ranks_in_their_own_processes_share_a_store_all_ranks_or_nothing(
        sgl: Any, galahad_settings: Any, tmp_path: Path) -> None:
    """Two TP ranks, each a process as SGLang runs them, write one chain at the same moment;
    rank 1 writes only its first 24 pages. Both find exactly those 24 (an entry counts only with
    every rank's part) and each reads its own shard back."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    go = tmp_path / "go"
    ranks = [subprocess.Popen([sys.executable, "-m", "sglang_support.rank", str(r), "2", "32", str(w), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, w in ((0, 32), (1, 24))]
    try:
        for proc in ranks:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        go.touch()
        outs = [proc.communicate(timeout=150) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    for proc, (out, err) in zip(ranks, outs):
        assert proc.returncode == 0, err[-4000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [len(r["written"]) for r in results] == [32, 24] and all(all(r["written"]) for r in results)
    for r in results:
        assert r["found"] == 24, r
        assert r["read"] == [True] * 24 and all(r["identical"]), r
        assert r["errors"] == 0 and r["timeouts"] == 0, r
