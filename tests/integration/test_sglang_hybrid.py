"""Hybrid models: the v2 multi-pool interface with SGLang's real KV and Mamba host pools.

A page of a hybrid model is usable only with every pool it needs (KV for each page, the mamba
state at the boundary); our answers are checked against SGLang's own reference backend
(`HiCacheFile`) given the same pools and the same calls.
"""

from __future__ import annotations

from typing import Any

import pytest

from sglang_support import harness
from sglang_support.fixtures import backends, galahad_settings, sgl  # noqa: F401 - fixtures

pytestmark = pytest.mark.sglang


def _attach(backend: Any, kv: Any, mamba: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend


def _transfers(keys: list[str], kv_idx: Any, mamba_keys: list[str], mamba_idx: Any) -> list[Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, host_indices=kv_idx, keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_idx, keys=mamba_keys,
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def _query(keys: list[str]) -> list[Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def test_hybrid_pages_restore_with_every_pool_or_not_at_all(sgl: Any, galahad_settings: Any, tmp_path: Any) -> None:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    kv, mamba = harness.make_pool("mha", "page_first"), harness.mamba_pool()
    harness.fill_random(kv, seed=31)
    harness.fill_random(mamba, seed=32)
    ours = _attach(StorageBackendFactory.create_backend("dynamic", harness.storage_config(), kv), kv, mamba)
    reference = _attach(HiCacheFile(harness.storage_config(extra={"file_storage_path": str(tmp_path / "ref")})),
                        kv, mamba)
    keys = harness.page_keys(list(range(4 * 16)), 16)
    kv_idx, m_idx = kv.alloc(4 * 16), mamba.alloc(2)
    # KV for all four pages; mamba states at the boundaries after page 2 and page 4
    for backend in (ours, reference):
        written = backend.batch_set_v2(_transfers(keys, kv_idx, [keys[1], keys[3]], m_idx))
        assert all(all(v) for v in written.values()), written
    try:
        for prefix in (keys, keys[:3], keys[:2]):
            got, want = ours.batch_exists_v2(prefix, _query(prefix)), reference.batch_exists_v2(prefix, _query(prefix))
            assert (got.kv_hit_pages, got.restorable_prefix_pages) == (want.kv_hit_pages, want.restorable_prefix_pages)
        assert ours.batch_exists_v2(keys, _query(keys)).kv_hit_pages == 4
        assert ours.batch_exists_v2(keys[:3], _query(keys[:3])).kv_hit_pages == 2  # no state after page 3

        # a restart: fresh pools, a fresh backend, everything read back identical
        kv2, mamba2 = harness.make_pool("mha", "page_first"), harness.mamba_pool()
        fresh = _attach(StorageBackendFactory.create_backend("dynamic", harness.storage_config(), kv2), kv2, mamba2)
        kv2_idx, m2_idx = kv2.alloc(4 * 16), mamba2.alloc(1)
        got = fresh.batch_get_v2(_transfers(keys, kv2_idx, [keys[3]], m2_idx))
        assert [list(v) for v in got.values()] == [[True] * 4, [True]]
        for i in range(4):
            assert torch.equal(kv.get_data_page(int(kv_idx[i * 16]), flat=True).view(torch.uint8),
                               kv2.get_data_page(int(kv2_idx[i * 16]), flat=True).view(torch.uint8))
        assert torch.equal(mamba.get_data_page(int(m_idx[1])), mamba2.get_data_page(int(m2_idx[0])))

        # lose the last mamba state: the 4-page prefix is no longer restorable, the 2-page one is
        ours_key = ours._key(keys[3], "mamba")  # noqa: SLF001 - the entry to lose
        ours._service.quarantine(ours_key, "test")  # noqa: SLF001
        result = fresh.batch_exists_v2(keys, _query(keys))
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [2])
        fresh.close()
    finally:
        ours.close()


def test_an_unserved_pool_policy_is_a_miss(sgl: Any, backends: Any) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv = harness.make_pool("mha", "page_first")
    backend = backends(kv)
    keys = harness.page_keys(list(range(2 * 16)), 16)
    assert all(backend.batch_set_v1(keys, kv.alloc(32)))
    unknown = [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert backend.batch_exists_v2(keys, unknown).kv_hit_pages == 0  # no indexer pool registered
    block = [PoolTransfer(name=PoolName.KV, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)]
    assert backend.batch_exists_v2(keys, block).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 2
