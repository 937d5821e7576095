"""Run vLLM 0.26 (GPU) offline in this process with Galahad, on a JSON job; write outputs as JSON.

    python tests/gpu/vllm_runner.py JOB.json

JOB: {"model", "llm": {LLM kwargs}, "kv": kv_transfer_config or null,
      "phases": [[{"ids", "max_tokens"}...]...], "out", "counters_file"}
After each phase with the connector on, waits until every save is committed (counters file).
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `compat.install()` here
reaches the scheduler and worker sides both.
"""

from __future__ import annotations

import json
import sys
import time


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def settle(llm: object, path: str | None, timeout: float = 60.0) -> dict:
    """Step the engine (tiny prompts, below GALAHAD_MIN_TOKENS) until no save awaits its commit.

    The engine runs in this process, so nothing steps it between `generate` calls: the workers'
    acknowledgements reach the scheduler side only while it steps.
    """
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    deadline = time.monotonic() + timeout
    while path and time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)  # type: ignore[attr-defined]
        time.sleep(0.05)
        if _read(path).get("pending_commits", 0) == 0:
            llm.generate([{"prompt_token_ids": [5, 6, 7, 9]}], sp, use_tqdm=False)  # type: ignore[attr-defined]
            break
    return _read(path) if path else {}


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams

    if job.get("kv"):
        from galahad.adapters.vllm import compat
        from galahad.adapters.vllm.registration import register_connector

        register_connector()
        compat.install()
    kwargs = dict(job.get("llm", {}))
    if job.get("kv"):
        kwargs["kv_transfer_config"] = job["kv"]
    llm = LLM(model=job["model"], **kwargs)
    result: dict = {"phases": [], "counters": []}
    for phase in job["phases"]:
        params = [SamplingParams(max_tokens=r.get("max_tokens", 16), temperature=0.0, ignore_eos=True,
                                 detokenize=False) for r in phase]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r["ids"]} for r in phase], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        result["phases"].append([
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
             "seconds": elapsed} for o in outs])
        result["counters"].append(settle(llm, job.get("counters_file")) if job.get("kv") else {})
    with open(job["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
