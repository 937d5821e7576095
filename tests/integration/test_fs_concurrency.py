"""Several processes on one store folder: no torn or mixed part, no committed entry lost, and a
reader racing an evicting process gets a part whole and right, or not at all.

GALAHAD_STORE_STRESS_S sets how long the four processes run (default 30 seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from galahad.adapters.fs import FilesystemBlockStore
from helpers.store_worker import NAMESPACE, SHARED_KEYS, SHARED_PARTS, check

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"
SECONDS = float(os.environ.get("GALAHAD_STORE_STRESS_S", "30"))


def _start(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _report(proc: subprocess.Popen[str], timeout: float) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out}\n{err}"
    return dict(json.loads(out.splitlines()[-1]))


def test_four_processes_sharing_keys_never_tear_mix_or_lose_a_committed_entry(tmp_path: Path) -> None:
    root = tmp_path / "store"
    FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=None).close()
    workers = [_start("stress", root, n, SECONDS) for n in range(4)]
    reports = [_report(w, SECONDS + 120) for w in workers]
    for report in reports:
        assert report["bad"] == [], "a read returned a torn, mixed or misplaced part"
        assert report["lost"] == [], "a committed entry read as absent"
    assert sum(r["reads"] for r in reports) > 100 and sum(r["puts"] for r in reports) > 10  # type: ignore[misc]
    promised = {h for r in reports for h in r["committed"]}  # type: ignore[attr-defined]
    assert promised, "no entry was ever committed"
    with FilesystemBlockStore(root, NAMESPACE, rescan_s=None) as store:
        assert promised <= {k.hex for k in store.committed()}
        for key in SHARED_KEYS:
            for part in SHARED_PARTS:
                data = store.get(key, part)
                assert data is None or check(key, part, data)


def test_readers_racing_an_evicting_process_get_whole_parts_or_none(tmp_path: Path) -> None:
    root = tmp_path / "store"
    FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=None).close()
    seconds = min(3.0, SECONDS)
    churn = _start("churn", root, seconds, 6 << 20)
    readers = [_start("read", root, n, seconds) for n in range(2)]
    evicted = _report(churn, seconds + 120)["evictions"]
    reports = [_report(r, seconds + 120) for r in readers]
    assert evicted > 0, "the churning process never evicted: the race was not run"
    assert all(r["bad"] == [] for r in reports), "a reader got part of a part"
    assert sum(r["hits"] for r in reports) > 0 and sum(r["misses"] for r in reports) > 0  # type: ignore[misc]
