"""`bench/gpu.py`'s report: the multi-turn runs' token identity, conversation by conversation, and
its ratio line, checked on written result lines (the benchmark itself needs the GPU machine).
Each multi-turn run's answers are compared with the first `turns-off` run's."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def _gpu_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("galahad_bench_gpu", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(work: Path, rows: list[dict[str, Any]]) -> None:
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ANSWERS = [[[5, 6, 7], [8, 9, 10]], [[1, 2, 3], [4, 5, 6]]]  # conversation, round, token
SCORES = [[[[-11.9, 0.0]] * 3] * 2] * 2  # [log-probability, lead over the runner-up] a token


def test_runs_that_answered_alike_differ_nowhere(tmp_path: Path) -> None:
    _write(tmp_path, [{"mode": "turns-off", "name": "answers", "answers": ANSWERS, "scores": SCORES},
                      {"mode": "turns-on", "name": "answers", "answers": ANSWERS, "scores": SCORES}])
    (line,) = _gpu_bench().compare_answers(tmp_path)
    assert line == ("answers: run 1 turns-on: 0 of 2 conversations differ; "
                    "largest log-probability change before a difference 0.0000")


def test_the_first_differing_token_of_each_conversation_is_named(tmp_path: Path) -> None:
    other = json.loads(json.dumps(ANSWERS))
    other[1][1][2] = 99  # conversation 1, round 1, token 2
    drifted = json.loads(json.dumps(SCORES))
    drifted[1][0][1][0] = -11.95  # a shared token's log-probability moved before it
    _write(tmp_path, [{"mode": "turns-off", "name": "answers", "answers": ANSWERS, "scores": SCORES},
                      {"mode": "turns-faulty", "name": "answers", "answers": other, "scores": drifted},
                      {"mode": "turns-on", "name": "answers", "answers": ANSWERS}])
    lines = _gpu_bench().compare_answers(tmp_path)
    assert lines[0] == ("answers: run 1 turns-faulty: 1 of 2 conversations differ; largest log-probability "
                        "change before a difference 0.0500\n    conv 1 round 1 token 2 (reference lead 0.0)")
    assert lines[1].endswith("0 of 2 conversations differ; largest log-probability change before a "
                             "difference n/a (no log-probabilities recorded)")


def test_without_turns_runs_nothing_is_said_and_without_a_reference_one_line(tmp_path: Path) -> None:
    bench = _gpu_bench()
    _write(tmp_path, [{"mode": "recompute", "name": "recompute_2048", "median_ms": 50.0}])
    assert bench.compare_answers(tmp_path) == []
    _write(tmp_path, [{"mode": "turns-on", "name": "answers", "answers": ANSWERS}])
    assert bench.compare_answers(tmp_path) == ["answers: no turns-off run to compare with"]


def test_the_ratio_line_divides_the_modes_it_names_and_says_n_a_for_the_rest(tmp_path: Path) -> None:
    rounds = [{"mode": m, "name": f"round_{i}", "turns": 24, "s": s} for m, s in
              (("turns-off", 4.0), ("turns-on", 2.0), ("turns-slow", 8.0)) for i in range(3)]
    rounds[0]["s"] = 6.0  # turns-off's first round; turns-on's took 2.0 s, turns-slow's 8.0 s
    rounds.append({"mode": "turns-slow", "name": "counters", "saves_skipped": 7})
    _write(tmp_path, [{"mode": "recompute", "name": "recompute_2048", "median_ms": 50.0},
                      {"mode": "load-plain", "name": "warm_2048", "median_ms": 10.0},
                      {"mode": "load-sealed", "name": "warm_2048", "median_ms": 12.0},
                      {"mode": "store-sealed", "name": "store_2048", "median_ms": 55.0},
                      {"mode": "load-fs", "name": "warm_2048", "median_ms": 40.0},
                      {"mode": "cold-sealed", "name": "cold_2048", "median_ms": 52.0},
                      {"mode": "cold-recompute", "name": "cold_2048", "median_ms": 52.0}, *rounds])
    assert _gpu_bench().summary(tmp_path).splitlines() == [
        "gpu-bench-plain: warm2k_vs_recompute=0.20 warm32k_vs_recompute=n/a cold2k_vs_recompute=n/a "
        "warm2k_vs_vllm_fs=0.25",
        "gpu-bench: new2k_sealed_vs_recompute=1.10 first32k_sealed_vs_recompute=n/a turns_round0_sealed_vs_off=3.00 "
        "turns_sealed_vs_off=2.00 turns_faulty_sealed_vs_off=n/a turns_slow_round0_sealed_vs_off=0.75 "
        "turns_slow_sealed_vs_off=0.50 slow_saves_skipped=7 cold2k_sealed_vs_recompute=1.04 "
        "warm2k_sealed_vs_recompute=0.24 warm32k_sealed_vs_recompute=n/a warm2k_sealed_vs_vllm_fs=0.30 "
        "cold2k_sealed_vs_cold_recompute=1.00"]


def test_the_summary_of_an_empty_folder_ends_with_the_ratio_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert _gpu_bench().main(["summary", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("gpu-bench: new2k_sealed_vs_recompute=n/a")
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_the_counters_are_read_from_the_totals_line_galahad_logs_at_shutdown() -> None:
    """The timed modes run without the counters-file test hook: their counters are the totals
    line the connector logs when the engine shuts down, read back name by name."""
    pytest.importorskip("vllm")
    from galahad.adapters.vllm.diagnostics import Diagnostics
    from galahad.adapters.vllm.stats import GalahadStats

    ours = logging.getLogger("galahad")
    level, totals = ours.level, _gpu_bench()._Totals()
    ours.setLevel(logging.INFO)  # as the connector sets it at startup (`registration.route_logs`)
    try:
        diag = Diagnostics()
        diag.observe_own(GalahadStats(data={"saves": 3, "saves_skipped": 2, "skipped_backlog": 2,
                                            "save_seconds": 0.125, "lookups": 4, "hits_disk": 1}))
        diag.log_totals()
        assert totals.line is not None
        counters = totals.counters()
        assert counters == {k: v for k, v in diag.totals().items() if v}  # every non-zero one, as logged
        assert counters["saves_skipped"] == 2 and counters["save_seconds"] == 0.125 and counters["hit_rate"] == 25.0
    finally:
        ours.setLevel(level)
        logging.getLogger("galahad.adapters.vllm.diagnostics").removeHandler(totals)
