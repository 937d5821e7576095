"""A worker that cannot cache, under a scheduler side that can: no hit is offered, nothing saved.

A worker's store may fail to open where the scheduler side's opened (a key command that failed in
that process only), or its KV cache layout may not be copyable. Every hit the scheduler side
offered would then fail on that rank: recomputed, or an error for the request under vLLM's
default `kv_load_failure_policy=fail`. The worker says it through vLLM's connector handshake
(after the workers register their KV caches, before the first request), and again in its first
step report; the scheduler side stops offering hits and shipping saves, with one `NOT CACHING`
line naming the rank and the reason.

The real vLLM runs (one worker, and two: tensor parallel) fill the store with a first server;
a second server's key command then fails once, in one worker (the workers run it before the
scheduler side), and works for every other process. The report path is checked over a real
service and store, the worker and scheduler objects driven directly.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from galahad.adapters.vllm.metadata import GalahadWorkerMetadata  # noqa: E402
from galahad.adapters.vllm.scheduler import GalahadScheduler  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from test_vllm_scheduler_saves import _prefill, _request, _write_and_ack  # noqa: E402
from test_service_commits import _service  # noqa: E402
from test_vllm_worker_reads import BLOCK, LAYERS, _config  # noqa: E402
from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.licence import make_licence  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
PROMPT = prompt_ids(700, 31)


def _once_failing_key_command(root: Path, key_file: Path) -> str:
    """A key command (a script named `vault`) that fails the first time it runs (of processes
    running it at once, exactly one: `mkdir` is atomic), then prints the key."""
    flag, script = root / "ran-once", root / "vault"
    script.write_text(f"#!/bin/sh\nif mkdir {shlex.quote(str(flag))} 2>/dev/null; then echo 'vault: sealed' >&2; "
                      f"exit 3; fi\ncat {shlex.quote(str(key_file))}\n")
    script.chmod(0o700)
    return str(script)


def _tokens(run: dict[str, Any]) -> list[tuple[list[int], str]]:
    return [(o["token_ids"], o["finish_reason"]) for phase in run["phases"] for o in phase]


def _worker_off(model: str, tmp_path: Path, tp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A first server (`tp` ranks) fills the store; a second's key command fails once, in one
    worker. The two runs."""
    phase = [[{"ids": PROMPT, "max_tokens": MAX_TOKENS}]]
    llm: dict[str, Any] = {"enable_prefix_caching": False, "tensor_parallel_size": tp}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "1"}
    first = GalahadEnv(tmp_path / "first", **bind)
    first.vars.update(zip(("GALAHAD_LICENCE_FILE", "GALAHAD_LICENCE_ISSUER_KEY"),
                          make_licence(first.root / "licence", points=tp, name=f"{tp}.lic")))
    filled = run_offline(model, phase, first, kv=kv_config(), llm=llm, name="fill")
    root = tmp_path / "second"
    root.mkdir()
    second = GalahadEnv(root, key=False, GALAHAD_CACHE_DIR=first.vars["GALAHAD_CACHE_DIR"],
                        GALAHAD_LICENCE_FILE=first.vars["GALAHAD_LICENCE_FILE"],
                        GALAHAD_LICENCE_ISSUER_KEY=first.vars["GALAHAD_LICENCE_ISSUER_KEY"],
                        GALAHAD_KEY_COMMAND=_once_failing_key_command(root, Path(first.vars["GALAHAD_KEY_FILE"])),
                        **bind)
    # vLLM's default policy: a hit the worker failed would fail the request (it did, before the
    # handshake: `Failing 1 request(s) due to KV load failure`, an empty answer)
    return filled, run_offline(model, phase, second, kv=kv_config("fail"), llm=llm, name="worker-off")


@pytest.fixture(scope="module")
def worker_off(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """The scenario with one worker and with two (tensor parallel), side by side."""
    model = build_model()
    with ThreadPoolExecutor(2) as pool:
        jobs = {tp: pool.submit(_worker_off, model, tmp_path_factory.mktemp(f"tp{tp}"), tp) for tp in (1, 2)}
        return {tp: job.result() for tp, job in jobs.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_worker_whose_store_did_not_open_stops_the_scheduler_offering_hits(
        worker_off: dict[int, tuple[dict[str, Any], dict[str, Any]]], tp: int) -> None:
    filled, run = worker_off[tp]
    assert filled["counters"][-1]["committed"] >= 1, filled["counters"]
    log = run["log"]
    (off,) = re.findall(r"\(worker rank (\d)\) NOT CACHING: key command `vault` failed", log)
    said = [line for line in log.splitlines() if "(scheduler) NOT CACHING" in line]
    assert len(said) == 1 and f"NOT CACHING from now on: worker rank {off} cannot cache: key command `vault` failed" \
        in said[0], said
    assert _tokens(run) == _tokens(filled)  # the whole answer, not an error
    c = run["counters"][-1] if run["counters"] else {}
    assert c.get("hits_disk", 0) == 0 and c.get("load_failures", 0) == 0 and c.get("saves", 0) == 0, c


# -- the report path (a worker in another process), without an engine ---------------------------


def test_a_worker_that_cannot_cache_says_so_once_in_its_report(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    assert worker.take_report() is None
    worker.cannot_cache("the KV cache layout cannot be copied as whole blocks (strided)")
    report = worker.take_report()
    assert report is not None and report.off == {0: "the KV cache layout cannot be copied as whole blocks (strided)"}
    assert worker.take_report() is None  # said once
    merged = GalahadWorkerMetadata().aggregate(GalahadWorkerMetadata(off={1: "x"}))
    assert isinstance(merged, GalahadWorkerMetadata) and merged.off == {1: "x"} and merged


@pytest.mark.parametrize("caches", ["none", "odd"])
def test_kv_caches_a_worker_cannot_use_make_it_say_so(tmp_path: Path, caches: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path / "store")
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    # no tensor for a layer (UnsupportedLayout), or tensors of a kind never foreseen
    kv = {} if caches == "none" else {f"layer.{i}": object() for i in range(LAYERS)}
    with caplog.at_level(logging.WARNING, logger="galahad"):
        worker.register(kv)  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("[galahad] (worker rank 0) NOT CACHING: "), said
    assert worker.off and worker.blocks is None
    report = worker.take_report()
    assert report is not None and report.off == {0: worker.off}


def test_a_report_that_a_worker_cannot_cache_stops_hits_and_saves(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True)
    tokens = list(range(5 * 64 + 1))
    _write_and_ack(sched, _prefill(sched, _request("a", tokens)))
    assert sched.matched(_request("b", tokens), 0)[0] > 0  # committed: offered

    with caplog.at_level(logging.WARNING, logger="galahad"):
        for _ in range(2):
            sched.update(NS(kv_connector_worker_meta=GalahadWorkerMetadata(off={1: "key command `vault` failed"})))
    lines = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert lines == ["[galahad] (scheduler) NOT CACHING from now on: worker rank 1 cannot cache: key command "
                     "`vault` failed; no more hits are offered and nothing more is saved (the stored entries "
                     "are kept); fix that rank's cause and restart"], lines
    assert sched.matched(_request("c", tokens), 0) == (0, False)
    assert _prefill(sched, _request("d", list(range(1000, 1000 + 5 * 64 + 1)))) == []  # no save shipped
