"""bench/gpu_hash.py compiled on a GPU: its frame tags equal xxhash's, and its speed is printed
for the issue note (`python bench/gpu_hash.py speed`). tests/unit/test_gpu_hash.py runs the same
check through Triton's interpreter on a CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("gpu: torch.cuda is not available", allow_module_level=True)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_hash.py"


@pytest.mark.parametrize("what", [["check"], ["speed", "--gb", "1"]])
def test_the_compiled_kernels_give_the_frame_tags_xxhash_gives(what: list[str]) -> None:
    done = subprocess.run([sys.executable, str(BENCH), *what], capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
