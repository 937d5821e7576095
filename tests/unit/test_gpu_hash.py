"""bench/gpu_hash.py's Triton kernels give format v1's frame tags (XXH3-128, seeded) bit for bit.

Run through Triton's interpreter on this CPU (`TRITON_INTERPRET=1`, a real Triton, the kernels'
own code, numpy doing the arithmetic); tests/gpu/test_gpu_hash.py runs the same check compiled
on a GPU. A kernel with one step wrong (a lane swap left out, a constant off by two) was checked
to fail it (twenty-third session).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_hash.py"


def test_the_triton_kernels_give_the_frame_tags_xxhash_gives() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(BENCH), "check", "--quick"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-hash check: ok" in done.stdout
