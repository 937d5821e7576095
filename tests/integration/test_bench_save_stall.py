"""bench/save_stall.py runs as a user runs it (small parts: the program is checked, not its
figures) and ends with its ratio line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "save_stall.py"


def test_the_save_stall_bench_ends_with_its_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--tokens", "64", "--saves", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"save-stall-bench: loop_p99_vs_idle=\d+\.\d\d longest_ms=\d+\.\d saved_gbps=\d+\.\d\d", last), last
    assert (tmp_path / "save-stall.json").exists()
