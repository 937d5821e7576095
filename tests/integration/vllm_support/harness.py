"""Starting real vLLM processes for the integration tests: offline jobs and an OpenAI server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GalahadEnv", "Server", "kv_config", "run_offline", "LLM_ARGS", "SERVER_ARGS"]

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
# float32: in bfloat16, vLLM's CPU build computes a prompt's tail after a prefix hit (its own prefix
# cache as much as a Galahad load) with matrix products of another shape than a full prefill, and
# the rounding differences flip greedy tokens of these random models now and then. Galahad's KV is
# byte-identical either way; float32 keeps vLLM's own noise below the models' logit margins.
LLM_ARGS: dict[str, Any] = {
    "block_size": BLOCK_SIZE, "gpu_memory_utilization": 0.3, "max_model_len": 4096,
    "dtype": "float32", "enforce_eager": True, "seed": 0,
}
SERVER_ARGS = ["--block-size", str(BLOCK_SIZE), "--gpu-memory-utilization", "0.3",
               "--max-model-len", "4096", "--dtype", "float32", "--enforce-eager", "--seed", "0"]


def kv_config(policy: str = "recompute", *, module_path: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "GalahadConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": policy}
    if module_path:
        cfg["kv_connector_module_path"] = "galahad_vllm.connector"
    return cfg


class GalahadEnv:
    """The environment of one scenario: a store, a key, a licence and a counters file in `root`."""

    def __init__(self, root: str | os.PathLike[str], *, licence: str | None = "ok", key: bool = True,
                 **settings: str) -> None:
        from vllm_support.licence import make_licence

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.counters_file = str(self.root / "counters.json")
        self.vars: dict[str, str] = {
            "GALAHAD_CACHE_DIR": str(self.root / "store"),
            "GALAHAD_MIN_TOKENS": "256",
            "GALAHAD_TEST_COUNTERS_FILE": self.counters_file,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOG_STATS_INTERVAL": "1",
            # one core for the model's OpenMP threads, so that several engines of a test can run
            # side by side on the two cores (the thread count sets the order of float sums)
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
        }
        if key:
            self.vars["GALAHAD_KEY_FILE"] = str(self.root / "store.key")
        if licence == "ok":
            lic, pub = make_licence(self.root / "licence")
            self.vars.update(GALAHAD_LICENCE_FILE=lic, GALAHAD_LICENCE_ISSUER_KEY=pub)
        elif licence is not None:
            self.vars.update(licence_vars(self.root / "licence", licence))
        self.vars.update(settings)

    def environ(self, **more: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_")}
        env.update(self.vars)
        env.update(more)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def counters(self) -> dict[str, Any]:
        try:
            return json.loads(Path(self.counters_file).read_text())
        except (OSError, ValueError):
            return {}

    def reset_counters(self) -> None:
        Path(self.counters_file).unlink(missing_ok=True)

    def store_files(self) -> list[Path]:
        store = Path(self.vars["GALAHAD_CACHE_DIR"])
        return sorted(p for p in store.rglob("*") if p.is_file()) if store.exists() else []


def licence_vars(folder: Path, kind: str) -> dict[str, str]:
    """Environment for a refused licence: `missing`, `expired` or `points` (too few)."""
    import datetime as dt

    from vllm_support.licence import make_licence

    if kind == "missing":
        _lic, pub = make_licence(folder)
        return {"GALAHAD_LICENCE_ISSUER_KEY": pub}
    if kind == "expired":
        lic, pub = make_licence(folder, issued=dt.date.today() - dt.timedelta(days=60), days=30,
                                name="expired.lic")
        return {"GALAHAD_LICENCE_FILE": lic, "GALAHAD_LICENCE_ISSUER_KEY": pub}
    if kind == "points":  # one point: too few for a server of two ranks
        lic, pub = make_licence(folder, points=1, name="one.lic")
        return {"GALAHAD_LICENCE_FILE": lic, "GALAHAD_LICENCE_ISSUER_KEY": pub}
    raise ValueError(kind)


def run_offline(model: str, phases: list[list[dict[str, Any]]], env: GalahadEnv | None, *,
                kv: dict[str, Any] | None = None, llm: dict[str, Any] | None = None,
                lora: dict[str, str] | None = None, extra_env: dict[str, str] | None = None,
                name: str = "run", timeout: float = 300, no_wait_after: list[int] | None = None,
                workdir: Path | None = None) -> dict[str, Any]:
    """Run one offline vLLM process over `phases`; returns outputs, counters and the log text.
    `no_wait_after`: phases after which the next starts at once, saves still being written.
    The job, its outputs and its log go to `env.root`, else `workdir`, else the temp folder."""
    root = env.root if env is not None else workdir or Path(os.environ.get("TMPDIR", "/tmp"))
    job_path, out_path, log_path = (root / f"{name}.job.json", root / f"{name}.out.json",
                                    root / f"{name}.log")
    job = {"model": model, "llm": {**LLM_ARGS, **(llm or {})}, "kv": kv, "phases": phases,
           "lora": lora or {}, "out": str(out_path),
           "counters_file": env.counters_file if env is not None else None,
           "no_wait_after_phase": no_wait_after or []}
    job_path.write_text(json.dumps(job))
    base = env.environ(**(extra_env or {})) if env is not None else _plain_env(extra_env)
    cmd = [sys.executable, "-m", "vllm_support.offline", str(job_path)]
    # vLLM alone (no connector): its CPU build's two-rank engine can hang after start-up beside
    # two other engines on two cores, with no connector configured; such a baseline run is run
    # once more. A run with a connector is never retried.
    attempts = 2 if kv is None else 1
    for attempt in range(attempts):
        try:
            returncode = _run_logged(cmd, base, log_path, timeout, done=lambda: _phases_done(out_path, len(phases)))
            break
        except subprocess.TimeoutExpired:
            if attempt + 1 == attempts:
                raise
            log_path.replace(root / f"{name}.hung.log")
    text = log_path.read_text(errors="replace")
    if returncode != 0 or not out_path.exists():
        raise RuntimeError(f"offline vLLM run {name} failed (rc {returncode}):\n{text[-6000:]}")
    result = json.loads(out_path.read_text())
    result["log"] = text
    return result


_EXIT_GRACE_S = 60.0  # after the last phase's results are written, the process has this long to exit


def _phases_done(out_path: Path, phases: int) -> bool:
    try:
        return len(json.loads(out_path.read_text())["phases"]) >= phases
    except (OSError, ValueError, KeyError):
        return False


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float,
                done: Callable[[], bool] | None = None) -> int:
    """Run `cmd` in a process group of its own, output to `log_path`; on a timeout the whole
    group is killed (vLLM's engine core and worker processes too), then TimeoutExpired raised.

    Once `done()` (every phase's results written, the engine shut down) the process gets
    `_EXIT_GRACE_S` more to exit. vLLM's CPU build can hang in its front-end process's own exit
    after it force-killed its engine process (the run's results and its engine's shutdown lines
    complete, the process sitting until the timeout); such a run is killed then and counts, with
    a line saying so at the end of its log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, finished = time.monotonic() + timeout, None
        try:
            while True:
                try:
                    return proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    now = time.monotonic()
                    if finished is None and done is not None and done():
                        finished = now
                    if finished is not None and now > finished + _EXIT_GRACE_S:
                        _kill_group(proc)
                        log.write(f"\n[harness] every phase's results were written; the process did not exit "
                                  f"{_EXIT_GRACE_S:.0f} s later and was killed (counted as finished)\n")
                        return 0
                    if now > deadline:
                        raise subprocess.TimeoutExpired(cmd, timeout) from None
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _plain_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A real `vllm.entrypoints.openai.api_server` process, with its log in `log_path`."""

    def __init__(self, model: str, env: dict[str, str], log_path: str | os.PathLike[str], *,
                 kv: dict[str, Any] | None = None, extra_args: list[str] | None = None) -> None:
        self.model, self.port, self.log_path = model, free_port(), Path(log_path)
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *(extra_args or [])]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited (rc {self.proc.returncode}):\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not ready after {timeout}s:\n{self.log()[-6000:]}")

    def complete(self, ids: list[int], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        """Greedy completion of token ids; returns {token_ids, finish_reason, ttft, status, error}."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True, **extra}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, ttft, ids_out, reason = time.perf_counter(), None, [], None
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        return {"status": 200, "error": chunk["error"], "token_ids": ids_out}
                    for choice in chunk.get("choices", []):
                        got = choice.get("token_ids") or []
                        if got and ttft is None:
                            ttft = time.perf_counter() - t0
                        ids_out.extend(got)
                        reason = choice.get("finish_reason") or reason
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, "error": exc.read().decode(errors="replace"), "token_ids": []}
        return {"status": 200, "token_ids": ids_out, "finish_reason": reason, "ttft": ttft,
                "error": None}

    def prometheus(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode(errors="replace")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metrics_lines(log: str) -> list[dict[str, float]]:
    """Every `KV Transfer metrics:` line of a log, parsed."""
    out = []
    for line in log.splitlines():
        if "KV Transfer metrics:" not in line:
            continue
        fields = {}
        for item in line.split("KV Transfer metrics:", 1)[1].split(","):
            if "=" in item:
                k, v = item.strip().split("=", 1)
                try:
                    fields[k] = float(v)
                except ValueError:
                    pass
        out.append(fields)
    return out


def wait_committed(env: GalahadEnv, *, at_least: int = 0, timeout: float = 60) -> dict[str, Any]:
    """Wait until the scheduler side reports no entry waiting for its parts (and `at_least` commits)."""
    deadline = time.monotonic() + timeout
    counters: dict[str, Any] = {}
    while time.monotonic() < deadline:
        counters = env.counters()
        if counters.get("pending_commits", 1) == 0 and counters.get("committed", 0) >= at_least:
            return counters
        time.sleep(0.3)
    raise TimeoutError(f"saves not committed after {timeout}s: {counters}")


def flip_bytes(path: Path, offsets: tuple[float, ...] = (0.5, 0.9)) -> None:
    """Damage a stored file in place: invert one byte at each relative offset."""
    data = bytearray(path.read_bytes())
    for rel in offsets:
        i = min(len(data) - 1, int(len(data) * rel))
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def block_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.blk") if "quarantine" not in p.parts)
