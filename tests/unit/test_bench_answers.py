"""`bench/gpu.py answers`: the multi-turn runs' token identity, conversation by conversation.

The GPU benchmark's `answers` lines are compared with the first `turns-off` run's; what the
comparison prints is what `docs/performance.md` reports of the H200 runs, so it is checked
here on written result lines (the benchmark itself needs the GPU machine). Also its mode
suffixes: `~sN` sets the checksum slice size, and other suffixes that begin with `s` do not."""

from __future__ import annotations

import importlib.util
import json
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
                      {"mode": "turns-proc4", "name": "answers", "answers": other, "scores": drifted},
                      {"mode": "turns-on", "name": "answers", "answers": ANSWERS}])
    lines = _gpu_bench().compare_answers(tmp_path)
    assert lines[0] == ("answers: run 1 turns-proc4: 1 of 2 conversations differ; largest log-probability "
                        "change before a difference 0.0500\n    conv 1 round 1 token 2 (reference lead 0.0)")
    assert lines[1].endswith("0 of 2 conversations differ; largest log-probability change before a "
                             "difference n/a (no GALAHAD_BENCH_LOGPROBS)")


def test_without_turns_runs_nothing_is_said_and_without_a_reference_one_line(tmp_path: Path) -> None:
    bench = _gpu_bench()
    _write(tmp_path, [{"mode": "recompute", "name": "recompute_2048", "median_ms": 50.0}])
    assert bench.compare_answers(tmp_path) == []
    _write(tmp_path, [{"mode": "turns-on", "name": "answers", "answers": ANSWERS}])
    assert bench.compare_answers(tmp_path) == ["answers: no turns-off run to compare with"]


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
def test_only_a_whole_s_number_suffix_is_a_slice_size(mode: str, kib: int | None) -> None:
    assert _gpu_bench().slice_kib(mode) == kib
