"""Pytest fixtures of the SGLang tests (imported by each `test_sglang_*.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_support import harness, load_sglang

__all__ = ["backends", "galahad_settings", "sgl"]


@pytest.fixture(scope="module")
def sgl() -> Any:
    """SGLang's `hicache_storage` module (the test is skipped without SGLang)."""
    return load_sglang()


@pytest.fixture
def galahad_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh encrypted store with a valid licence, set in this process's environment."""
    env = harness.galahad_env(tmp_path / "galahad")
    harness.apply_env(monkeypatch, env)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    return env


@pytest.fixture
def backends(sgl: Any, galahad_settings: dict[str, str]) -> Iterator[Callable[..., Any]]:
    """`make(pool, **config)`: a backend built by SGLang's factory (`dynamic`), pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    made: list[Any] = []

    def make(pool: Any, **config: Any) -> Any:
        backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(**config), pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
