"""Fail open: whatever goes wrong below it, the backend answers "not found" (or "not written"),
counts it, returns within its time bound, and never hands SGLang a byte it did not verify.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sglang_support import harness
from sglang_support.faults import FailingStore, HangingStore
from sglang_support.fixtures import backends, galahad_settings, sgl  # noqa: F401 - fixtures

pytestmark = pytest.mark.sglang


def _every_call(backend: Any, pool: Any, keys: list[str]) -> dict[str, Any]:
    """Call every method SGLang may call; return what each answered."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    idx = pool.alloc(len(keys) * pool.page_size)
    transfer = PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)
    flat = [pool.get_data_page(int(i), flat=True) for i in idx[:: pool.page_size]]
    out = {
        "batch_exists": backend.batch_exists(keys),
        "exists": backend.exists(keys[0]),
        "batch_get_v1": backend.batch_get_v1(keys, idx),
        "batch_set_v1": backend.batch_set_v1(keys, idx),
        "batch_get": backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]),
        "get": backend.get(keys[0], pool.get_dummy_flat_data_page()),
        "batch_set": backend.batch_set(keys, flat),
        "set": backend.set(keys[0], flat[0]),
        "batch_exists_v2": backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.KV, keys=keys,
                                                                       hit_policy=PoolHitPolicy.ALL_PAGES)]),
        "batch_get_v2": backend.batch_get_v2([transfer]),
        "batch_set_v2": backend.batch_set_v2([transfer]),
        "clear": backend.clear(),
    }
    backend.get_stats()
    return out


def _nothing_found(answers: dict[str, Any], n: int) -> None:
    assert answers["batch_exists"] == 0 and answers["exists"] is False
    assert answers["batch_get_v1"] == [False] * n and answers["batch_set_v1"] == [False] * n
    assert answers["batch_get"] == [None] * n and answers["get"] is None
    assert answers["batch_set"] is False and answers["set"] is False
    assert answers["batch_exists_v2"].kv_hit_pages == 0
    assert list(answers["batch_get_v2"].values()) == [[False] * n]
    assert list(answers["batch_set_v2"].values()) == [[False] * n]


@pytest.mark.parametrize("error", [OSError, RuntimeError, "StoreUnavailable"])
def test_a_store_that_fails_every_call_gives_not_found_and_counts(sgl: Any, backends: Any, error: Any) -> None:
    from galahad.domain.error import StoreUnavailable

    pool = harness.make_pool("mha", "page_first")
    backend = backends(pool)
    keys = harness.page_keys(list(range(3 * 16)), 16)
    assert all(backend.batch_set_v1(keys, pool.alloc(3 * 16)))  # stored while the disk was fine
    svc = backend._service  # noqa: SLF001 - break the medium under the service
    svc.store = FailingStore(svc.store, StoreUnavailable if error == "StoreUnavailable" else error)
    answers = _every_call(backend, pool, keys)
    _nothing_found(answers, 3)
    assert answers["clear"] is False  # SGLang's clear endpoint is not told it worked
    counts = backend.counters()
    assert counts["errors"] + counts["store_load_failures"] + counts["store_saves_skipped"] > 0
    assert svc.store.calls > 0


def test_a_hung_store_never_holds_an_sglang_thread_past_the_limit(sgl: Any, backends: Any) -> None:
    pool = harness.make_pool("mla", "page_first_direct")
    backend = backends(pool, mla=True, extra={"galahad_timeout_s": 0.3})
    keys = harness.page_keys(list(range(2 * 16)), 16)
    svc = backend._service  # noqa: SLF001
    hung = HangingStore(svc.store)
    svc.store = hung
    try:
        for call in (lambda: backend.batch_exists(keys), lambda: backend.batch_set_v1(keys, pool.alloc(32)),
                     lambda: backend.batch_get_v1(keys, pool.alloc(32)), lambda: backend.batch_get(keys)):
            t0 = time.monotonic()
            answer = call()
            assert time.monotonic() - t0 < 1.5
            assert answer in (0, [False, False], [None, None])
        assert backend.counters()["timeouts"] >= 4
    finally:
        hung.release()


def test_sglang_fault_injection_at_full_rate_reports_not_found(sgl: Any, galahad_settings: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    pool = harness.make_pool("mha", "layer_first")
    backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(), pool)
    backend.register_mem_pool_host(pool)
    try:
        assert isinstance(backend, HiCacheStorageFailureInjector)
        keys = harness.page_keys(list(range(2 * 16)), 16)
        _nothing_found(_every_call(backend, pool, keys), 2)
    finally:
        backend.close()


def test_sglang_fault_injection_at_half_rate_never_yields_a_wrong_page(sgl: Any, galahad_settings: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    pool = harness.make_pool("mha", "page_first")
    harness.fill_random(pool, seed=21)
    backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(), pool)
    backend.register_mem_pool_host(pool)
    found = 0
    try:
        for round_ in range(30):
            keys = harness.page_keys(list(range(round_, round_ + 4 * 16)), 16)
            src = pool.alloc(4 * 16)
            written = backend.batch_set_v1(keys, src)
            hits = backend.batch_exists(keys)
            dst = pool.alloc(4 * 16)
            got = backend.batch_get_v1(keys, dst)
            assert hits <= sum(1 for _ in written) and len(got) == 4
            for i, ok in enumerate(got):
                if ok:
                    found += 1
                    a = pool.get_data_page(int(src[i * 16]), flat=True).view(torch.uint8)
                    b = pool.get_data_page(int(dst[i * 16]), flat=True).view(torch.uint8)
                    assert torch.equal(a, b)
            pool.free(src)
            pool.free(dst)
    finally:
        backend.close()
    assert found > 0  # the half that went through really round-tripped


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_never_returned_as_a_hit(sgl: Any, backends: Any, galahad_settings: Any,
                                                  damage: str) -> None:
    import torch

    pool = harness.make_pool("mha", "page_first")
    harness.fill_random(pool, seed=9)
    backend = backends(pool)
    keys = harness.page_keys(list(range(4 * 16)), 16)
    assert all(backend.batch_set_v1(keys, pool.alloc(4 * 16)))
    victim = backend._key(keys[2]).hex  # noqa: SLF001 - which file on disk is page 2
    (path,) = glob.glob(os.path.join(galahad_settings["GALAHAD_CACHE_DIR"], "ns-*", "*", "*", f"{victim}.p0.blk"))
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        if damage == "flip":
            handle.seek(size // 2)
            byte = handle.read(1)
            handle.seek(size // 2)
            handle.write(bytes([byte[0] ^ 0x01]))
        else:
            handle.truncate(size - 100)
    reader = backends(harness.make_pool("mha", "page_first"))  # a new instance: nothing cached in memory
    dst = reader.mem_pool_host.alloc(4 * 16)
    assert reader.batch_get_v1(keys, dst) == [True, True, False, False]
    assert not pool.get_data_page(0, flat=True).view(torch.uint8).equal(
        reader.mem_pool_host.get_data_page(int(dst[32]), flat=True).view(torch.uint8))
    assert not reader.mem_pool_host.get_data_page(int(dst[32]), flat=True).any()  # page 2 left untouched
    counts = reader.counters()
    assert counts["store_refused_damaged"] == 1 and counts["store_quarantined"] == 1
    assert reader.batch_exists(keys) == 2  # quarantined for every rank


def test_without_a_licence_the_backend_serves_nothing_and_says_why(sgl: Any, backends: Any,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("GALAHAD_LICENCE_FILE")
    pool = harness.make_pool("mha", "page_first")
    with caplog.at_level(logging.INFO):
        backend = backends(pool)
    assert not backend.enabled
    assert "NOT CACHING" in caplog.text
    keys = harness.page_keys(list(range(2 * 16)), 16)
    _nothing_found(_every_call(backend, pool, keys), 2)
    assert backend.counters()["disabled_calls"] > 0


@pytest.mark.parametrize("value", [True, 0, -1, 601, "soon", None])
def test_a_call_limit_that_is_not_seconds_is_refused_naming_it(value: Any) -> None:
    from galahad.adapters.sglang.identity import BackendOptions
    from galahad.domain.error import ConfigError

    if value is None:
        assert BackendOptions.parse({"galahad_timeout_s": 2}).timeout_s == 2.0
        return
    with pytest.raises(ConfigError, match=r"galahad_timeout_s=.* use seconds in \(0, 600\]"):
        BackendOptions.parse({"galahad_timeout_s": value})  # `true` was taken as 1 s


def test_a_malformed_setting_disables_caching_instead_of_killing_sglang(sgl: Any, backends: Any,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("GALAHAD_MAX_BYTES", "lots")
    pool = harness.make_pool("mha", "page_first")
    with caplog.at_level(logging.WARNING):
        backend = backends(pool, extra={"galahad_timeout_s": "soon"})
    assert not backend.enabled
    assert "NOT CACHING" in caplog.text and "galahad_timeout_s" in caplog.text
    (record,) = [r for r in caplog.records if "NOT CACHING" in r.getMessage()]
    said = record.getMessage()
    assert record.levelno == logging.WARNING  # as every other NOT CACHING line (bootstrap's)
    assert said.startswith("[galahad] NOT CACHING: extra config galahad_timeout_s="), said  # the message itself (docs/configuration.md)
    assert backend.batch_exists(harness.page_keys(list(range(16)), 16)) == 0


def test_wrong_host_indices_are_a_miss_not_a_crash(sgl: Any, backends: Any) -> None:
    pool = harness.make_pool("mha", "page_first")
    backend = backends(pool)
    keys = harness.page_keys(list(range(2 * 16)), 16)
    assert backend.batch_set_v1(keys, pool.alloc(16)) == [False, False]
    assert backend.batch_get_v1(keys, None) == [False, False]
    assert backend.batch_set(keys, [None, None]) is False


def test_a_store_folder_others_can_write_to_is_refused_with_the_fix_and_no_errno(
        sgl: Any, backends: Any, galahad_settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    root = Path(galahad_settings["GALAHAD_CACHE_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o777)
    try:
        with caplog.at_level(logging.WARNING):
            backend = backends(harness.make_pool("mha", "page_first"))
        assert not backend.enabled
        (said,) = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
        assert "NOT CACHING: store folder" in said and f"chmod 700 {root}" in said, said
        assert "[Errno" not in said, said  # the message, not OSError's formatting of it
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_an_unsupported_host_layout_is_refused_at_startup_with_one_line_naming_the_fix(
        sgl: Any, backends: Any, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's `page_unified` pools cannot hand over a page whole (`get_data_page` raises): the
    backend used to say "ready" and then fail every write and read as an error."""
    import torch

    pool = harness.make_pool(kind, "page_unified")
    with caplog.at_level(logging.INFO):
        backend = backends(pool, mla=kind == "mla")
    assert not backend.enabled
    (said,) = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert "'page_unified'" in said and "--hicache-mem-layout page_first_direct" in said, said
    assert "SGLang backend ready" not in caplog.text
    keys = harness.page_keys(list(range(2 * 16)), 16)
    idx = pool.alloc(2 * 16)
    assert backend.batch_set_v1(keys, idx) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, idx) == [False, False]
    assert backend.batch_set(keys, [torch.zeros(4), torch.zeros(4)]) is False
    counts = backend.counters()
    assert counts["errors"] == 0 and counts["disabled_calls"] >= 4, counts
    assert counts["reason"] == said.removeprefix("[galahad] NOT CACHING: ")


def test_a_model_path_that_is_not_a_folder_disables_caching_naming_it(
        sgl: Any, backends: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It used to fall back to the served name in silence (the warning said to set `model_path`,
    which was set): two checkpoints under one name then shared entries."""
    typo = str(tmp_path / "models" / "Qwen3-8B-typo")
    pool = harness.make_pool("mha", "page_first")
    with caplog.at_level(logging.WARNING):
        backend = backends(pool, model="served-name", extra={"model_fingerprint": None, "model_path": typo})
    assert not backend.enabled
    (said,) = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert f"model_path={typo!r} is not a folder" in said and "model_fingerprint" in said, said
    assert backend.batch_exists(harness.page_keys(list(range(16)), 16)) == 0


def test_a_changed_key_is_said_once_with_the_fix_and_loses_nothing_stored(
        sgl: Any, backends: Any, galahad_settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Entries sealed under a key this server does not hold are kept and missed; without a word
    the store looked empty after a key change."""
    pool = harness.make_pool("mha", "page_first")
    keys = harness.page_keys(list(range(4 * 16)), 16)
    assert all(backends(pool).batch_set_v1(keys, pool.alloc(4 * 16)))
    monkeypatch.setenv("GALAHAD_KEY_FILE", str(tmp_path / "another.key"))  # created with a fresh key
    with caplog.at_level(logging.DEBUG, logger="galahad"):
        other = backends(harness.make_pool("mha", "page_first"))
        assert other.enabled
        assert other.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 0
    said = [r for r in caplog.records if "cannot open" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said  # once (each header is read once)
    assert "retired line of the key file" in said[0].getMessage()
    assert other.counters()["errors"] == 0
    monkeypatch.setenv("GALAHAD_KEY_FILE", galahad_settings["GALAHAD_KEY_FILE"])
    assert backends(harness.make_pool("mha", "page_first")).batch_exists(keys) == 4  # nothing was lost


def test_after_a_key_rotation_pages_saved_again_are_written_anew_under_the_new_key(
        sgl: Any, backends: Any, galahad_settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/security.md, Rotation: a retired key's entries are recomputed and saved under the key
    in use. SGLang's set used to answer "already stored" for them, so they stayed misses for good."""
    pool = harness.make_pool("mha", "page_first")
    keys = harness.page_keys(list(range(4 * 16)), 16)
    assert all(backends(pool).batch_set_v1(keys, pool.alloc(4 * 16)))
    (old,) = [line for line in Path(galahad_settings["GALAHAD_KEY_FILE"]).read_text().splitlines()
              if line and not line.startswith("#")]
    new = os.urandom(32).hex()
    rotating = tmp_path / "rotating.key"  # step 2: the new key first, the old one a retired line
    rotating.write_text(f"{new}\n{old}\n")
    rotating.chmod(0o600)
    monkeypatch.setenv("GALAHAD_KEY_FILE", str(rotating))
    assert backends(harness.make_pool("mha", "page_first")).batch_exists(keys) == 4  # still read
    rotated = tmp_path / "rotated.key"  # step 3: the old key's line deleted
    rotated.write_text(f"{new}\n")
    rotated.chmod(0o600)
    monkeypatch.setenv("GALAHAD_KEY_FILE", str(rotated))
    other_pool = harness.make_pool("mha", "page_first")
    other = backends(other_pool)
    assert other.batch_exists(keys) == 0
    assert all(other.batch_set_v1(keys, other_pool.alloc(4 * 16)))  # what SGLang does after the miss
    counts = other.counters()
    assert counts["pages_written"] == 4 and counts["pages_present"] == 0, counts
    assert other.batch_exists(keys) == 4 and counts["errors"] == 0


class _CountingStore:
    """The real store, counting `is_committed` calls (how many lookups one SGLang call costs)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.lookups = 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._real, name)
        if name != "is_committed":
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.lookups += 1
            return target(*args, **kwargs)

        return counted


def test_odd_copy_interface_arguments_get_an_answer_per_key_within_one_lookup(sgl: Any, backends: Any) -> None:
    """A non-writer rank's `batch_set` asked the store once per page for the whole batch (n^2
    lookups, each with its own time limit); an empty batch was "not written"; fewer targets than
    keys gave a shorter answer (and an error counted)."""
    writer_pool = harness.make_pool("mla", "page_first")
    writer = backends(writer_pool, mla=True, tp_rank=0, tp_size=2)
    reader_pool = harness.make_pool("mla", "page_first")
    reader = backends(reader_pool, mla=True, tp_rank=1, tp_size=2)
    keys = harness.page_keys(list(range(8 * 16)), 16)
    assert all(writer.batch_set_v1(keys, writer_pool.alloc(8 * 16)))
    flat = [reader_pool.get_data_page(i * 16, flat=True) for i in range(8)]
    store = _CountingStore(reader._service.store)  # noqa: SLF001 - count what one call asks the store
    reader._service.store = store  # noqa: SLF001
    assert reader.batch_set(keys, flat) is True  # TP rank 0 has written them: durable
    assert store.lookups <= 2 * len(keys), store.lookups
    assert reader.batch_set([], []) is True and writer.batch_set([], []) is True
    got = writer.batch_get(keys[:3], [writer_pool.get_dummy_flat_data_page()])
    assert got == [None, None, None]
    assert writer.counters()["errors"] == 0 and reader.counters()["errors"] == 0


def test_a_misspelt_galahad_key_in_the_extra_config_is_named_not_silently_ignored(
        sgl: Any, backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend = backends(harness.make_pool("mha", "page_first"),
                           extra={"galahad_timeout": 30, "prefetch_threshold": 256})  # `_s` left out
    assert backend.enabled  # left alone, like SGLang's own keys
    said = [r.getMessage() for r in caplog.records if "extra config key" in r.getMessage()]
    assert len(said) == 1 and "'galahad_timeout'" in said[0] and "galahad_timeout_s" in said[0], said


@pytest.mark.parametrize(("name", "value", "named"), [
    ("GALAHAD_MAX_BYTES", "lots", "GALAHAD_MAX_BYTES='lots' is not accepted; use a byte count"),
    ("GALAHAD_KEY_FILE", " ", "GALAHAD_KEY_FILE is set but empty"),
    ("GALAHAD_MIN_TOKENS", "-1", "GALAHAD_MIN_TOKENS='-1' is not accepted; use a whole number"),
    ("GALAHAD_PAYLOAD_ORDER", "chunks", "GALAHAD_PAYLOAD_ORDER='chunks' is not accepted"),
])
def test_a_malformed_environment_setting_alone_is_one_not_caching_line_naming_it(
        sgl: Any, backends: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        name: str, value: str, named: str) -> None:
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO):
        backend = backends(harness.make_pool("mha", "page_first"))
    assert not backend.enabled
    (said,) = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert said.startswith(f"[galahad] NOT CACHING: {named}"), said
    assert backend.batch_exists(harness.page_keys(list(range(16)), 16)) == 0
    assert backend.counters()["errors"] == 0
