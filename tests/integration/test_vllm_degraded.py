"""When Galahad may not or cannot cache, vLLM serves normally (offline vLLM runs).

No licence, an expired licence, a licence with too few points, a model whose KV cache groups
Galahad does not plan (chunked local attention):
correct answers, nothing written, the reason said once per process. A store on a full or read-only filesystem: serving continues,
saves counted as skipped (needs root to mount a small tmpfs; skipped otherwise).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.hybrid_model import build_llama4_chunked  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
PROMPTS = [prompt_ids(700, 21), prompt_ids(400, 22)]


def _phases() -> list[list[dict[str, Any]]]:
    return [[{"ids": p, "max_tokens": MAX_TOKENS} for p in PROMPTS], [{"ids": PROMPTS[0], "max_tokens": MAX_TOKENS}]]


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for phase in run["phases"] for o in phase]


@pytest.fixture(scope="module")
def model() -> str:
    return build_model()


def _licence_run(model: str, root: Path, kind: str) -> tuple[GalahadEnv, dict[str, Any]]:
    llm: dict[str, Any] = {"enable_prefix_caching": False}
    if kind == "points":  # a 1-point licence on a 2-rank (TP=2) server
        llm["tensor_parallel_size"] = 2
        env = GalahadEnv(root / kind, licence=kind, VLLM_CPU_OMP_THREADS_BIND="0|1")
    else:
        env = GalahadEnv(root / kind, licence=kind, VLLM_CPU_OMP_THREADS_BIND="1")
    return env, run_offline(model, _phases(), env, kv=kv_config(), llm=llm, name=kind)


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain baseline and the three licence refusals, side by side."""
    root = tmp_path_factory.mktemp("licence")
    with ThreadPoolExecutor(5) as pool:
        plain = pool.submit(run_offline, model, _phases(), GalahadEnv(root / "plain"), kv=None,
                            name="plain")
        refused = {k: pool.submit(_licence_run, model, root, k) for k in ("missing", "expired", "points")}
        hybrid_env = GalahadEnv(root / "hybrid", VLLM_CPU_OMP_THREADS_BIND="1")
        hybrid = pool.submit(run_offline, build_llama4_chunked(), _phases(), hybrid_env, kv=kv_config(),
                             llm={"enable_prefix_caching": False}, name="hybrid")
        bad = pool.submit(_refused_start, model, root)
        out: dict[str, Any] = {"plain": _tokens(plain.result()), "hybrid": (hybrid_env, hybrid.result()),
                               "bad-setting": bad.result()}
        out.update({k: f.result() for k, f in refused.items()})
    return out


def _refused_start(model: str, root: Path) -> str:
    env = GalahadEnv(root / "bad", GALAHAD_PAYLOAD_ORDER="chunks", VLLM_CPU_OMP_THREADS_BIND="1")
    try:
        run_offline(model, _phases(), env, kv=kv_config(), name="bad")
    except RuntimeError as exc:
        return str(exc)
    return "started"


@pytest.fixture(scope="module")
def baseline(runs: dict[str, Any]) -> list[list[int]]:
    return runs["plain"]


def _not_caching_lines(log: str) -> Counter[str]:
    """NOT CACHING lines per process (the pid prefix vLLM writes)."""
    return Counter(m.group(1) for m in re.finditer(r"\((\w+ pid=\d+)\).*NOT CACHING", log))


@pytest.mark.parametrize("kind", ["missing", "expired", "points"])
def test_without_a_valid_licence_vllm_serves_correctly_writes_nothing_and_says_why_once(
        kind: str, runs: dict[str, Any], baseline: list[list[int]]) -> None:
    env, run = runs[kind]
    tokens = _tokens(run)
    if kind != "points":  # TP=2 sums in another order: compare lengths only
        assert tokens == baseline
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert env.store_files() == []
    reason = {"missing": "licence refused (missing)", "expired": "licence refused (expired)",
              "points": "licence refused (too few points)"}[kind]
    lines = [line for line in run["log"].splitlines() if "NOT CACHING" in line]
    assert lines and all(reason in line for line in lines), lines
    per_process = _not_caching_lines(run["log"])
    assert len(per_process) == (3 if kind == "points" else 2)  # scheduler + each worker
    assert set(per_process.values()) == {1}, per_process
    assert "caching ENABLED" not in run["log"]


def test_a_malformed_setting_stops_vllm_at_startup_naming_the_setting(runs: dict[str, Any]) -> None:
    failure = runs["bad-setting"]
    assert failure != "started"
    assert "GALAHAD_PAYLOAD_ORDER='chunks' is not accepted; use one of: layer, chunk" in failure


def test_a_model_with_groups_galahad_cannot_plan_is_served_without_caching_and_says_why(
        runs: dict[str, Any]) -> None:
    env, run = runs["hybrid"]
    assert all(len(t) == MAX_TOKENS for t in _tokens(run))
    assert "[galahad] (scheduler) hybrid KV plan unavailable: a ChunkedLocalAttentionSpec group" in run["log"]
    assert "NOT CACHING: hybrid KV plan unavailable" in run["log"]
    assert "Turning off hybrid kv cache manager" not in run["log"]  # SupportsHMA: vLLM keeps HMA on
    assert env.store_files() == []


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    mnt = tmp_path_factory.mktemp("smallfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768k,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_store_keeps_serving_and_counts_saves_as_skipped(
        model: str, baseline: list[list[int]], small_fs: Path, tmp_path: Path) -> None:
    env = GalahadEnv(tmp_path, GALAHAD_CACHE_DIR=str(small_fs / "store"))
    run = run_offline(model, _phases(), env, kv=kv_config(), llm={"enable_prefix_caching": False},
                      name="full")
    assert _tokens(run) == baseline
    c = run["counters"][-1]
    assert c["saves_skipped"] == 3 and c["saves"] == 0 and c["errors"] == 0, c  # 2 prompts, 1 repeated
    assert "save skipped (the store refused a write)" in run["log"]


def test_a_read_only_store_keeps_serving_and_counts_saves_as_skipped(
        model: str, baseline: list[list[int]], small_fs: Path, tmp_path: Path) -> None:
    # a cap far above the part size: the write itself meets the read-only filesystem
    env = GalahadEnv(tmp_path, GALAHAD_CACHE_DIR=str(small_fs / "store"), GALAHAD_MAX_BYTES="1G")
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True)
    assert done.returncode == 0, done.stderr
    try:
        run = run_offline(model, _phases(), env, kv=kv_config(), llm={"enable_prefix_caching": False},
                          name="readonly")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], capture_output=True)
    assert _tokens(run) == baseline
    assert "NOT CACHING" not in run["log"]
    c = run["counters"][-1]
    assert c["saves_skipped"] == 3 and c["saves"] == 0 and c["errors"] == 0, c  # 2 prompts, 1 repeated
    assert "Read-only file system" in run["log"] or "read-only" in run["log"], run["log"][-3000:]
