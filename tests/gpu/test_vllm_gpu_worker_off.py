"""On the GPU (vLLM 0.26, one worker in the engine's process): a worker that cannot cache, under a
scheduler side that can, stops the scheduler side offering hits before the first request.

(A) fills the store; (B) starts over it with a key command that fails once: in the worker, which
opens its store first (the scheduler side's run works). Under vLLM's default
`kv_load_failure_policy=fail` a hit the worker could only fail would fail the request: (B) must
answer every prompt whole, with no hit offered and nothing saved, and say `NOT CACHING from now on`
once. The same check as `tests/integration/test_vllm_worker_off.py` on the CPU build (vLLM 0.32,
the worker in a process of its own).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from .test_vllm_gpu_restart import _run, _tokens

pytestmark = pytest.mark.gpu


def test_a_worker_whose_key_command_failed_stops_the_scheduler_offering_hits(tmp_path: Path) -> None:
    from vllm_support.licence import make_licence
    from vllm_support.model import SMALL, build_model, prompt_ids

    model = build_model(SMALL)
    lic, pub = make_licence(tmp_path / "licence")
    prompts = [{"ids": prompt_ids(641, 11), "max_tokens": 8}, {"ids": prompt_ids(1025, 12), "max_tokens": 8}]
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_MIN_TOKENS": "256",
           "GALAHAD_LICENCE_FILE": lic, "GALAHAD_LICENCE_ISSUER_KEY": pub}
    key = tmp_path / "store.key"
    filled = _run(tmp_path, "a-fill", model, [prompts],
                  {**env, "GALAHAD_KEY_FILE": str(key), "GALAHAD_TEST_COUNTERS_FILE": str(tmp_path / "a.json")})
    assert filled["counters"][-1].get("committed", 0) == 2, filled["counters"]
    flag, script = tmp_path / "ran-once", tmp_path / "vault"
    script.write_text(f"#!/bin/sh\nif mkdir {shlex.quote(str(flag))} 2>/dev/null; then echo 'vault: sealed' >&2; "
                      f"exit 3; fi\ncat {shlex.quote(str(key))}\n")
    script.chmod(0o700)
    off = _run(tmp_path, "b-worker-off", model, [prompts],
               {**env, "GALAHAD_KEY_COMMAND": str(script), "GALAHAD_TEST_COUNTERS_FILE": str(tmp_path / "b.json")},
               policy="fail")
    log = (tmp_path / "b-worker-off.log").read_text()
    assert "(worker rank 0) NOT CACHING: key command `vault` failed" in log, log[-3000:]
    said = [line for line in log.splitlines() if "(scheduler) NOT CACHING from now on: worker rank 0" in line]
    assert len(said) == 1, log[-3000:]
    assert _tokens(off["phases"][0]) == _tokens(filled["phases"][0])  # whole answers, not errors
    c: dict[str, Any] = off["counters"][-1]
    assert c.get("hits_disk", 0) == 0 and c.get("saves", 0) == 0 and c.get("load_failures", 0) == 0, c
