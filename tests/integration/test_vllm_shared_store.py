"""Several vLLM servers, one store on a real distributed filesystem (GlusterFS), each node on its
own mount of the volume (real OpenAI servers and offline engines, vLLM's CPU build).

- Node A answers prompts and is stopped; node B, started fresh on its own mount, answers the same
  prompts warm (loaded from what A saved) and token-identical to vLLM alone. The same with
  GALAHAD_TEST_PERTURB_LOAD on B changes the tokens: the identity check can fail.
- A and B serve at once with overlapping prompts (both save the same entries at once): identical.
- A is SIGKILLed right after answering new prompts, its saves in flight; B answers those prompts
  identically, and nothing torn or foreign is served: no load refused as damaged, and
  `galahad-format verify` finds no problem in the store.
- A tensor-parallel pair: two ranks on node A save, two ranks on node B load, identical tokens.

Skipped where GlusterFS cannot run (gluster_support.py) or vLLM is absent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from gluster_support import GlusterVolume, volume  # noqa: E402,F401 - the fixture
from vllm_support.harness import GalahadEnv, Server, kv_config, run_offline, wait_committed  # noqa: E402
from vllm_support.licence import make_licence  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.gluster]

MAX_TOKENS = 16
PROMPTS = [prompt_ids(n, seed) for n, seed in [(700, 301), (520, 302)]]
TOGETHER = [prompt_ids(n, seed) for n, seed in [(600, 303), (640, 304)]]  # asked of A and B at once
KILLED = [prompt_ids(n, seed) for n, seed in [(900, 305), (800, 306)]]  # A is killed after these
STORE = "galahad"  # GALAHAD_CACHE_DIR below each node's mount


def _node(root: Path, name: str, mount: Path, key_file: str, **settings: str) -> GalahadEnv:
    """One node's settings: the store below its own mount, its own licence and counters file,
    the key every node shares."""
    env = GalahadEnv(root / name, **settings)
    env.vars.update(GALAHAD_CACHE_DIR=str(mount / STORE), GALAHAD_KEY_FILE=key_file)
    return env


def _ids(answers: list[dict[str, Any]]) -> list[list[int]]:
    for a in answers:
        assert a["status"] == 200 and a["error"] is None, a
    return [a["token_ids"] for a in answers]


@pytest.fixture(scope="module")
def runs(volume: GlusterVolume, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_model()
    root = tmp_path_factory.mktemp("shared")
    key = str(root / "store.key")  # made by the first server that starts; every node holds it
    a_mount, b_mount = volume.mounts[:2]
    out: dict[str, Any] = {}

    def alone() -> None:
        env = GalahadEnv(root / "alone")
        with Server(model, env.environ(VLLM_CPU_OMP_THREADS_BIND="1"), root / "alone.log") as server:
            out["alone"] = _ids([server.complete(p, MAX_TOKENS) for p in PROMPTS + TOGETHER + KILLED])

    def first_a() -> None:
        node = _node(root, "a1", a_mount, key)
        with Server(model, node.environ(VLLM_CPU_OMP_THREADS_BIND="0"), root / "a1.log", kv=kv_config()) as server:
            out["a1"] = _ids([server.complete(p, MAX_TOKENS) for p in PROMPTS])
            out["a1_counters"] = wait_committed(node, at_least=len(PROMPTS), timeout=120)

    _side_by_side(alone, first_a)

    started = threading.Barrier(2)
    killed = threading.Event()

    def node_b() -> None:
        node = _node(root, "b", b_mount, key)
        with Server(model, node.environ(VLLM_CPU_OMP_THREADS_BIND="1"), root / "b.log", kv=kv_config()) as server:
            out["b_warm"] = _ids([server.complete(p, MAX_TOKENS) for p in PROMPTS])
            out["b_warm_counters"] = dict(wait_committed(node, timeout=120))
            started.wait(timeout=300)
            out["b_together"] = _ids([server.complete(p, MAX_TOKENS) for p in TOGETHER])
            killed.wait(timeout=300)
            out["b_killed"] = _ids([server.complete(p, MAX_TOKENS) for p in KILLED])
            out["b_counters"] = wait_committed(node, timeout=120)
            out["b_log"] = server.log()

    def node_a_killed() -> None:
        node = _node(root, "a2", a_mount, key)
        server = Server(model, node.environ(VLLM_CPU_OMP_THREADS_BIND="0"), root / "a2.log", kv=kv_config())
        try:
            server.wait_ready()
            started.wait(timeout=300)
            out["a_together"] = _ids([server.complete(p, MAX_TOKENS) for p in TOGETHER])
            out["a_killed"] = _ids([server.complete(p, MAX_TOKENS) for p in KILLED])
            os.killpg(server.proc.pid, signal.SIGKILL)  # its saves of KILLED still being written
            server.proc.wait(timeout=30)
        finally:
            killed.set()
            server.stop()

    _side_by_side(node_b, node_a_killed)

    perturbed = _node(root, "b-perturbed", b_mount, key, GALAHAD_TEST_PERTURB_LOAD="1")
    with Server(model, perturbed.environ(VLLM_CPU_OMP_THREADS_BIND="1"), root / "b-perturbed.log",
                kv=kv_config()) as server:
        out["perturbed"] = _ids([server.complete(p, MAX_TOKENS) for p in PROMPTS])
        out["perturbed_counters"] = wait_committed(perturbed, timeout=120)

    phases = [[{"ids": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]]
    for name, mount in (("tp-a", a_mount), ("tp-b", b_mount)):
        node = _node(root, name, mount, key)
        lic, pub = make_licence(node.root / "licence", points=2, name="two.lic")  # two ranks: two points
        node.vars.update(GALAHAD_LICENCE_FILE=lic, GALAHAD_LICENCE_ISSUER_KEY=pub)
        run = run_offline(model, phases, node, kv=kv_config(),
                          llm={"tensor_parallel_size": 2}, name=name,
                          extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        out[name] = [o["token_ids"] for o in run["phases"][0]]
        out[f"{name}_counters"] = run["counters"][0]
        out[f"{name}_log"] = run["log"]

    tool = Path(sys.executable).with_name("galahad-format")
    out["verify"] = subprocess.run([str(tool), "verify", str(b_mount / STORE)], capture_output=True, text=True,
                                   env={**os.environ, "GALAHAD_KEY_FILE": key}, timeout=300)
    return out


def _side_by_side(*jobs: Any) -> None:
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def test_node_b_started_fresh_on_its_own_mount_answers_what_node_a_saved_warm_and_identical(
        runs: dict[str, Any]) -> None:
    assert runs["a1"] == runs["alone"][: len(PROMPTS)]
    assert runs["a1_counters"]["committed"] >= len(PROMPTS)
    assert runs["b_warm"] == runs["alone"][: len(PROMPTS)]
    assert runs["b_warm_counters"]["hits_disk"] >= len(PROMPTS)  # loaded what A saved, not recomputed
    assert runs["b_warm_counters"].get("load_failures", 0) == 0


def test_loads_perturbed_on_node_b_change_the_tokens_so_the_identity_check_can_fail(runs: dict[str, Any]) -> None:
    assert runs["perturbed_counters"]["hits_disk"] >= len(PROMPTS)
    assert runs["perturbed"] != runs["alone"][: len(PROMPTS)]


def test_two_nodes_serving_the_same_prompts_at_once_answer_identically(runs: dict[str, Any]) -> None:
    expected = runs["alone"][len(PROMPTS): len(PROMPTS) + len(TOGETHER)]
    assert runs["a_together"] == expected and runs["b_together"] == expected


def test_a_node_killed_while_saving_leaves_nothing_torn_or_foreign_for_another(runs: dict[str, Any]) -> None:
    expected = runs["alone"][len(PROMPTS) + len(TOGETHER):]
    assert runs["a_killed"] == expected
    assert runs["b_killed"] == expected
    refused = runs["b_counters"].get("refused", {})
    assert not {r: n for r, n in refused.items() if r in ("damaged", "format", "namespace")}, refused
    assert "Traceback" not in runs["b_log"]
    verify = runs["verify"]
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert " 0 bad" in verify.stdout and "BAD" not in verify.stdout


def test_a_tensor_parallel_pair_loads_on_node_b_what_the_pair_on_node_a_saved(runs: dict[str, Any]) -> None:
    assert runs["tp-a_counters"]["committed"] >= len(PROMPTS)
    assert runs["tp-b"] == runs["tp-a"]
    assert runs["tp-b_counters"]["hits_disk"] >= len(PROMPTS), runs["tp-b_log"][-3000:]


def test_every_node_names_the_shared_filesystem_once_at_startup(runs: dict[str, Any]) -> None:
    assert "fuse.glusterfs, a shared network filesystem" in runs["b_log"]
    assert "NOT CACHING" not in runs["b_log"]


def test_a_server_whose_filesystem_goes_away_serves_on_and_caches_again_when_it_is_back(
        runs: dict[str, Any], volume: GlusterVolume, tmp_path: Path) -> None:
    """The volume's brick SIGKILLed under a serving node: answers stay right (recomputed), one
    line says the store is not answering, saves are skipped; the brick restarted, the node says
    caching resumed and saves again, without a restart."""
    key = str(tmp_path / "store.key")
    node = _node(tmp_path, "faults", volume.mounts[1] / "galahad-faults", key)
    expected = dict(zip(map(tuple, PROMPTS + TOGETHER + KILLED), runs["alone"]))
    with Server(build_model(), node.environ(VLLM_CPU_OMP_THREADS_BIND="1"), tmp_path / "faults.log",
                kv=kv_config()) as server:
        assert _ids([server.complete(PROMPTS[0], MAX_TOKENS)]) == [expected[tuple(PROMPTS[0])]]
        before = wait_committed(node, at_least=1, timeout=120)["committed"]
        volume.kill_brick()
        try:
            down = [TOGETHER[0], PROMPTS[1]]
            assert _ids([server.complete(p, MAX_TOKENS) for p in down]) == [expected[tuple(p)] for p in down]
            log = server.log()
            out = [line for line in log.splitlines() if "is not answering" in line]
            assert out and all("Transport endpoint is not connected" in line for line in out), out
            said = Counter(line.split(")", 1)[0] for line in out)  # "(EngineCore pid=N", "(Worker pid=M"
            assert set(said.values()) == {1}, out  # once in each process that opened the store
        finally:
            volume.start_brick()
        # each process that opened the store finds it again on its own (the worker's store writes
        # the saves): the next request is sent once every one of them said so
        deadline = time.monotonic() + 60
        while not set(said) <= {line.split(")", 1)[0] for line in server.log().splitlines()
                                if "caching resumed" in line}:
            assert time.monotonic() < deadline, f"caching did not resume in every process: {server.log()[-3000:]}"
            time.sleep(0.5)
        assert _ids([server.complete(KILLED[0], MAX_TOKENS)]) == [expected[tuple(KILLED[0])]]
        counters = wait_committed(node, at_least=before + 1, timeout=120)
        assert counters["saves_skipped"] >= 1  # the saves made while it was down
        assert "Traceback" not in server.log()
