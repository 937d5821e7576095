"""The Triton kernels of `galahad.adapters.vllm.xxh3_gpu` (run by bench/gpu_hash.py) give format v1's frame tags (XXH3-128, seeded) bit for bit.

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


def test_the_kernels_compile_for_the_h200_without_a_gpu() -> None:
    """The interpreter runs the kernels as Python; the compiler accepts less (no generator
    expressions, for one). Compiled here for sm_90 with Triton's bundled CUDA backend, as the
    H200 machine would (no driver needed)."""
    code = (
        "import triton\n"
        "from galahad.adapters.vllm import xxh3_gpu as g\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "t = GPUTarget('cuda', 90, 32)\n"
        "p = dict.fromkeys(('kwords', 'seeds', 'sums'), '*i64')\n"
        "a = {'data': '*i64', **p, 'last_keys': '*i64', 'first_block': 'i64', 'n_blocks': 'i32',\n"
        "     'blocks_per_frame': 'i32', 'total_blocks': 'i64', 'BPP': 'constexpr'}\n"
        "b = {**p, 'accs': '*i64', 'blocks_per_frame': 'i32', 'total_blocks': 'i64', 'TILE': 'constexpr'}\n"
        "for fn, sig, const in ((g._block_sums, a, {'BPP': 16}), (g._frame_accs, b, {'TILE': 16})):\n"
        "    assert 'cubin' in triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=t).asm\n"
        "print('compiled')\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    if "No module named 'triton.backends.nvidia'" in done.stderr:
        pytest.skip("this Triton has no CUDA backend")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr
