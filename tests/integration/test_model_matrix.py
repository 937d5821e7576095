"""The model matrix (bench/models.py) as a test: architectures of different kinds, each built
locally with random weights, served by real vLLM (CPU build) alone, then with Galahad, then
restarted with Galahad: the restarted process must load what the first saved and answer token for
token as vLLM alone did; a model Galahad cannot cache must say why and be served normally.

Every run: a dense model (Llama), one with sliding-window layers (Gemma 3), a hybrid with a
running state (Qwen3-Next), and one Galahad does not cache there (DeepSeek-V2's MLA). The whole matrix is slow-marked (`bash scripts/test.sh --run-slow`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


def _matrix() -> Any:
    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "bench" / "models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MATRIX = _matrix()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_each_kind_restarts_warm_with_identical_tokens(arch: str, tmp_path: Path) -> None:
    kind, overrides = MATRIX.ARCHS[arch]
    row = MATRIX.run_one(arch, kind, overrides, tmp_path)
    assert row["status"] == "cached", row
    assert row["identical"] and row["hits_disk"] >= 1 and row["saved_bytes"] > 0, row


def test_a_model_galahad_cannot_cache_says_why_and_answers_as_vllm_alone(tmp_path: Path) -> None:
    """DeepSeek-V2's MLA on vLLM's CPU build has no attention over cached tokens (a load there
    gave other answers): Galahad says so at startup, neither saves nor loads, and the answers
    are vLLM's own."""
    kind, overrides = MATRIX.ARCHS["deepseek_v2"]
    row = MATRIX.run_one("deepseek_v2", kind, overrides, tmp_path)
    assert row["status"] == "not cached" and "MLA" in row["reason"], row
    assert row["identical"] and row["hits_disk"] == 0 and row["saved_bytes"] == 0, row


@pytest.mark.slow
def test_the_whole_matrix_has_no_wrong_answer_and_no_crash(tmp_path: Path) -> None:
    rows = [MATRIX.run_one(arch, kind, overrides, tmp_path) for arch, (kind, overrides) in MATRIX.ARCHS.items()]
    failed = [r for r in rows if r["status"].startswith("FAILED")]
    assert not failed, failed
    assert sum(r["status"] == "cached" for r in rows) >= 25, [(r["arch"], r["status"]) for r in rows]
