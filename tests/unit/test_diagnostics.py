"""The test-only counters file (`GALAHAD_TEST_COUNTERS_FILE`) is written off the engine's thread:
handing over the totals returns at once, the file ends up holding the newest totals, and a
flush (shutdown) writes what is waiting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from galahad.adapters.vllm import diagnostics  # noqa: E402
from galahad.adapters.vllm.diagnostics import Diagnostics  # noqa: E402


def _wait_for(path: Path, pending: int, seconds: float = 10.0) -> dict:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = json.loads(path.read_text())
            if data.get("pending_commits") == pending:
                return data
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError(f"{path} never showed pending_commits={pending}")


def test_the_newest_totals_reach_the_file_without_the_caller_writing_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "counters.json"
    diag = Diagnostics(counters_file=str(path))
    slow = diagnostics._write_json

    def slow_write(p: str, data: dict) -> None:  # a disk whose rename takes 50 ms
        time.sleep(0.05)
        slow(p, data)

    monkeypatch.setattr(diagnostics, "_write_json", slow_write)
    t0 = time.perf_counter()
    for pending in range(1, 41):
        diag.set_pending(pending)
    assert time.perf_counter() - t0 < 0.5  # 40 writes of 50 ms were not made on this thread
    assert _wait_for(path, 40)["pending_commits"] == 40  # the newest, not a queue of old ones
    diag.set_pending(0)
    diag.flush()
    assert json.loads(path.read_text())["pending_commits"] == 0


def test_finished_requests_are_counted_in_the_scheduler_file_with_the_pending_commits(tmp_path: Path) -> None:
    """A test waits for `test_requests_finished` to reach what it sent and `pending_commits` 0
    (vllm_support/offline.py): both come in one snapshot, the count only on the scheduler side."""
    path = tmp_path / "counters.json"
    diag = Diagnostics(counters_file=str(path))
    diag.set_pending(2)  # the connector sets the pending saves first (request_finished)
    diag.note_finished()
    diag.note_finished()
    diag.flush()
    data = json.loads(path.read_text())
    assert data["test_requests_finished"] == 2 and data["pending_commits"] == 2
    worker = Diagnostics(counters_file=str(path), rank=1)
    worker.note_finished()  # never called on a worker; if it were, its file would not carry it
    worker.flush()
    assert "test_requests_finished" not in json.loads((tmp_path / "counters.json.rank1").read_text())
    assert Diagnostics().note_finished() is None  # no file: nothing counted, nothing written
