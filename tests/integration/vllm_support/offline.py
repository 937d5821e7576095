"""Run vLLM's offline `LLM` in this process on a JSON job; write the outputs as JSON.

    python -m vllm_support.offline JOB.json

JOB: {"model", "llm": {LLM kwargs}, "kv": kv_transfer_config or null, "lora": {name: path},
      "phases": [[{"ids", "max_tokens", "cache_salt", "lora"}...]...], "out", "counters_file",
      "touch_before_phase": {"<phase index>": path of a file to create before that phase},
      "no_wait_after_phase": [phase indices]}
VLLM_SUPPORT_MOUNTINFO=PATH (environment, test only): every process of the run reads PATH as its
mount table (/proc/self/mountinfo), so a store can be shown on network storage.
Phases run one after another; after each (except those in "no_wait_after_phase", whose counters
are left empty: the next phase starts while their saves are still being written), the runner
waits until every save is committed and rewrites "out" (so a run killed midway leaves the phases
it finished). "ranks" holds, per phase,
each worker's own totals (`counters_file.rank<N>`).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

if os.environ.get("VLLM_SUPPORT_MOUNTINFO"):  # test only: read this file as the mount table
    # Done at import: vLLM starts its engine and worker processes with spawn here, which imports
    # this module again in each of them (with fork they inherit it). Only the table is faked:
    # the store is opened and the warning logged by the real code, through vLLM's log handlers.
    from galahad.adapters.fs import mount as _mount

    _mount._MOUNTINFO = os.environ["VLLM_SUPPORT_MOUNTINFO"]


def _wait_committed(path: str | None, finished: int, timeout: float = 60.0) -> dict:
    """The counters once a snapshot shows `finished` requests finished and no commit pending.

    The file is written by a thread of the engine, newest snapshot first: right after `generate`
    returns it may still hold an older one (on a busy machine, for seconds), which says nothing
    is pending only because this phase's saves are not in it yet."""
    start = time.monotonic()
    last: dict = {}
    while path and time.monotonic() < start + timeout:
        time.sleep(0.1)
        try:
            with open(path) as f:
                last = json.load(f)
        except (OSError, ValueError):
            if not last and time.monotonic() > start + 5:
                break  # no file at all: Galahad's connector is not in this engine
            continue
        if last.get("pending_commits", 0) == 0 and last.get("test_requests_finished", 0) >= finished:
            time.sleep(0.3)  # the workers' own files (`_ranks`) are written by threads of their own
            break
    return last


def _ranks(path: str | None) -> dict[str, dict]:
    out = {}
    for name in sorted(glob.glob(f"{path}.rank*")) if path else []:
        try:
            with open(name) as f:
                out[name.rsplit(".rank", 1)[1]] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def _dump(result: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs = dict(job.get("llm", {}))
    if job.get("kv"):
        kwargs["kv_transfer_config"] = job["kv"]
    llm = LLM(model=job["model"], **kwargs)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(job.get("lora", {}).items())}
    result = {"phases": [], "counters": [], "ranks": []}
    sent = 0
    for index, phase in enumerate(job["phases"]):
        gate = job.get("touch_before_phase", {}).get(str(index))
        if gate:  # a test hook's gate (GALAHAD_TEST_SAVE_DELAY): from this phase on
            open(gate, "w").close()
        prompts, params, lora = [], [], []
        for r in phase:
            p = TokensPrompt(prompt_token_ids=r["ids"])
            if r.get("cache_salt"):
                p["cache_salt"] = r["cache_salt"]
            prompts.append(p)
            params.append(SamplingParams(max_tokens=r.get("max_tokens", 16), temperature=0.0, ignore_eos=True))
            lora.append(loras.get(r["lora"]) if r.get("lora") else None)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora if any(lora) else None, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        sent += len(prompts)
        result["phases"].append([
            {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
             "num_cached_tokens": o.num_cached_tokens, "seconds": elapsed}
            for o in outs
        ])
        wait = job.get("kv") and index not in job.get("no_wait_after_phase", [])
        result["counters"].append(_wait_committed(job.get("counters_file"), sent) if wait else {})
        result["ranks"].append(_ranks(job.get("counters_file")) if job.get("kv") else {})
        _dump(result, job["out"])
    del llm


if __name__ == "__main__":
    main(sys.argv[1])
