"""`bench/gpu.py`'s mode suffixes: `~sN` sets the checksum slice size; other suffixes that begin
with `s` do not."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("galahad_bench_gpu_modes", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("mode", "kib"), [
    ("load-plain~s512", 512),
    ("load-plain~nopreload~s4096", 4096),
    ("cold-sealed~s256~preload", 256),
    ("load-plain~seq", None),
    ("load-plain~sync2", None),
    ("load-plain~s", None),
    ("load-plain", None),
    ("load-plainsync", None),
])
def test_only_a_whole_s_number_suffix_is_a_slice_size(gpu_bench: ModuleType, mode: str, kib: int | None) -> None:
    assert gpu_bench.slice_kib(mode) == kib
