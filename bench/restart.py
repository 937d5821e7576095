"""Restart benchmark: how much sooner does vLLM answer a prompt it has seen before a restart, with
Galahad loading its KV from disk instead of recomputing it, and what does saving cost a busy
server? vLLM's CPU build, a small random-weight model; a benchmark, not a test.

    python bench/restart.py [--quick] [--pairs N] [--out DIR] [--keep] [--slow-disk SECONDS]

1. A vLLM OpenAI server with Galahad and a fresh store answers prompts of 1k, 2k and 4k tokens
   (saving them), and is stopped.
2. A new server process with Galahad answers the same prompts (loaded from disk: warm) and fresh
   prompts of the same lengths (recomputed: cold), alternating, `--repeats` times each.
3. Steady-state generation throughput, on `--pairs` pairs of freshly started servers (one with
   Galahad on the same store, one without, up side by side; each pair started in the other order
   than the one before): batches of concurrent requests (distinct prompts, so Galahad saves every
   one) sent to each server in turn. After six untimed batches each (a server started a minute
   before runs its first batches slower), `--rounds` batches each, alternating which goes first;
   each round's two batches, one after the other, give a ratio, and a pair's figure is the median
   of its rounds, so a drift of the machine's speed, or one slow batch, moves it little. The figure
   is the median over the pairs: a server process keeps a speed of its own for its life, so a
   single pair measures partly which processes it got (less so with every server's memory on huge
   pages, below). Each batch starts once the other server's worker has gone idle: after its last
   step a vLLM worker keeps polling for the next one for a second (`busy_loop_s` in vLLM's
   shm_broadcast.py), on the core both models run on, and a batch started in that second ran 1.4
   times slower. The pause also lets the last saves of a batch finish before the next one starts (a
   server under constant load seals them beside its next requests): a batch is charged for the
   saves made while it runs.

`--slow-disk SECONDS` makes the store a disk slower than the saves: every part Galahad writes waits
SECONDS on its save thread first (the test hook GALAHAD_TEST_SAVE_DELAY), in every Galahad server;
the saves the servers skipped meanwhile are reported (`saves_skipped`).

Both kinds of server get the same OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`, default core 0),
since vLLM's CPU build otherwise reserves one more core when a KV connector is configured, and put
their large allocations (weights, KV cache) on transparent huge pages (PyTorch's
`THP_MEM_ALLOC_ENABLE=1`; nothing changes where the kernel has them off): with 4 KiB pages a
server's speed depended on where its memory landed, and pairs of servers without caching gave
ratios of 0.88 to 1.09; with huge pages 0.97 to 1.03.
The figures (restart.json), the plot (restart-bench.png) and the servers' logs go to `--out DIR`,
default bench/out/restart-<YYYYmmdd-HHMMSS>/; the store is a temporary folder, removed at the end
unless `--keep`. docs/benchmarks.md ("Restart") shows a run.

The last line is `restart-bench: warm_ttft_vs_cold=R1 save_throughput_vs_off=R2`: R1 is the time to
first token of a 2k-token prompt loaded after the restart over that of one recomputed (below 1:
the restart costs less), R2 the generation throughput with Galahad saving over that without, the
median over the pairs of each pair's median over its rounds (1.00: saving costs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from galahad.cli.demo import Server, build_model, demo_environ, prompt_ids

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import PLOT_SKIPPED, pyplot, run_folder  # noqa: E402

BENCH_MODEL: dict[str, Any] = dict(
    vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, init_std=0.05,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)  # about 260 M parameters
QUICK_MODEL: dict[str, Any] = dict(BENCH_MODEL, hidden_size=512, intermediate_size=2048,
                                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)


def _ttfts(server: Server, prompts: list[list[int]]) -> list[float]:
    return [server.ask(p, 4)[1] for p in prompts]


# seconds a vLLM worker keeps polling for its next step after its last one (shm_broadcast.py's
# `busy_loop_s`, 1 s), and a margin: a batch waits that long after the other server's
IDLE_S = 1.5
WARMUP_BATCHES = 6  # untimed batches each server runs before the rounds


def _throughput(server: Server, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """Generated tokens per second for `prompts` sent all at once, and the seconds it took,
    started once every worker that ran a step before has stopped polling (`IDLE_S`)."""
    time.sleep(IDLE_S)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: server.ask(p, max_tokens)[0], prompts))
    took = time.perf_counter() - t0
    return sum(len(o) for o in outs) / took, took


def _started(model: str, env: dict[str, str], log: Path, *, galahad: bool = True) -> Server:
    server = Server(model, env, log, galahad=galahad)
    server.wait_ready()
    return server


def _pair(args: argparse.Namespace, model: str, env: dict[str, str], out: Path, vocab: int, pair: int,
          tokens: dict[str, float], seconds: dict[str, float]) -> tuple[list[float], dict[str, float]]:
    """One pair of fresh servers, with Galahad (`on`) and without (`off`): both run
    `WARMUP_BATCHES` untimed batches, then `--rounds` batches each, alternating which goes first;
    each round's two batches give a ratio. Returns the ratios and the Galahad server's metrics;
    adds each side's generated tokens and seconds to `tokens` and `seconds`. Every pair's prompts
    are its own, so the Galahad server saves every batch."""
    order = [("on", True), ("off", False)] if pair % 2 == 0 else [("off", False), ("on", True)]
    servers: dict[str, Server] = {}
    try:
        for side, galahad in order:
            servers[side] = _started(model, env, out / f"pair{pair + 1}-{side}.log", galahad=galahad)
        # A server started a minute ago ran its first batches up to 9% slower than one serving for
        # longer (two servers without Galahad's caching, in turn), which favoured the one up first.
        seed = 100_000 * (pair + 1)
        for i in range(WARMUP_BATCHES):
            warm_up = [prompt_ids(args.batch_tokens, seed + 100 * i + j, vocab) for j in range(args.batch)]
            for side, _galahad in order:
                _throughput(servers[side], warm_up, args.gen_tokens)
        ratios = []
        for r in range(args.rounds):
            batch = [prompt_ids(args.batch_tokens, seed + 10_000 + 100 * r + i, vocab) for i in range(args.batch)]
            rates = {}
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                rates[side], took = _throughput(servers[side], batch, args.gen_tokens)
                tokens[side] += rates[side] * took
                seconds[side] += took
            ratios.append(rates["on"] / rates["off"])
        return ratios, servers["on"].metrics()
    finally:
        for server in servers.values():
            server.stop()


def run(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    model = build_model(spec)
    vocab = spec["vocab_size"]
    env = demo_environ(work)  # an encrypted store, as documented
    if args.slow_disk:
        env["GALAHAD_TEST_SAVE_DELAY"] = f"0:{args.slow_disk}"
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.threads
    # huge pages: a server's speed no longer depends on where its memory landed (docstring)
    env["THP_MEM_ALLOC_ENABLE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096]
    stored = {n: prompt_ids(n, 1000 + n, vocab) for n in lengths}
    print(f"[bench] model {model}; prompts {lengths}; threads {args.threads}", flush=True)

    server = _started(model, env, out / "first.log")
    try:
        _ttfts(server, [stored[n] for n in lengths])  # saves
        server.wait_metric("committed", len(lengths))
    finally:
        server.stop()

    result: dict[str, Any] = {"lengths": lengths, "warm": {}, "cold": {}}
    server = _started(model, env, out / "restart.log")
    try:
        for n in lengths:
            warm, cold = [], []
            for r in range(args.repeats):
                warm.append(_ttfts(server, [stored[n]])[0])  # first one loads from disk
                cold.append(_ttfts(server, [prompt_ids(n, 5000 + 97 * r + n, vocab)])[0])
            result["warm"][n], result["cold"][n] = warm, cold
            print(f"[bench] {n} tokens: cold {statistics.median(cold):.3f} s, "
                  f"warm {statistics.median(warm):.3f} s", flush=True)
        result["metrics_restart"] = server.metrics()
    finally:
        server.stop()

    # Steady-state throughput on `--pairs` pairs of fresh servers; the figure is the median over
    # the pairs (a server process keeps a speed of its own for its life: the docstring)
    tokens = {"on": 0.0, "off": 0.0}
    seconds = {"on": 0.0, "off": 0.0}
    result["pair_ratios"], result["round_ratios"], result["metrics_pairs"] = [], [], []
    for pair in range(args.pairs):
        ratios, metrics = _pair(args, model, env, out, vocab, pair, tokens, seconds)
        result["round_ratios"].append(ratios)
        result["pair_ratios"].append(statistics.median(ratios))
        result["metrics_pairs"].append(metrics)
        print(f"[bench] pair {pair + 1}: throughput with Galahad over without, median "
              f"{result['pair_ratios'][-1]:.3f} (rounds " + " ".join(f"{x:.2f}" for x in ratios) + ")", flush=True)
    result["throughput_on"] = tokens["on"] / seconds["on"]
    result["throughput_off"] = tokens["off"] / seconds["off"]
    return result


def _plot(result: dict[str, Any], path: Path) -> str:
    """Time to first token, recomputed and loaded, per prompt length; returns the line to print."""
    plt = pyplot()
    if plt is None:
        return PLOT_SKIPPED
    lengths = result["lengths"]
    cold = [statistics.median(result["cold"][n]) for n in lengths]
    warm = [statistics.median(result["warm"][n]) for n in lengths]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(lengths))
    ax.bar([x - 0.2 for x in xs], cold, 0.4, label="recomputed (cold)")
    ax.bar([x + 0.2 for x in xs], warm, 0.4, label="loaded by Galahad after a restart")
    ax.set_xticks(list(xs), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("time to first token (s)")
    ax.set_title("vLLM CPU: time to first token after a restart")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 1k and 2k prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests for throughput")
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=4,
                        help="pairs of fresh servers (with Galahad, without) the throughput is measured on")
    parser.add_argument("--rounds", type=int, default=4, help="throughput batches per server of a pair, alternating")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--out", help="folder for the figures, the plot and the logs "
                        "(default: bench/out/restart-<YYYYmmdd-HHMMSS>)")
    parser.add_argument("--keep", action="store_true", help="keep the store (its folder is printed)")
    parser.add_argument("--slow-disk", type=float, default=0.0, metavar="SECONDS",
                        help="every save waits this long before it is written (a disk slower than the saves)")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.rounds < 1:
        parser.error("--pairs and --rounds must be at least 1")
    out = run_folder("restart", args.out)
    work = Path(tempfile.mkdtemp(prefix="galahad-restart-bench-"))
    try:
        result = run(args, work, out)
    finally:
        if args.keep:
            print(f"[bench] store kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    at = 2048
    r1 = statistics.median(result["warm"][at]) / statistics.median(result["cold"][at])
    r2 = statistics.median(result["pair_ratios"])
    result.update(warm_ttft_vs_cold=r1, save_throughput_vs_off=r2)
    saves = sum(m.get("saves", 0) for m in result["metrics_pairs"])
    skipped = sum(m.get("saves_skipped", 0) for m in result["metrics_pairs"])
    print(f"[bench] throughput with Galahad saving {result['throughput_on']:.1f} tok/s, "
          f"without {result['throughput_off']:.1f} tok/s; saves {saves:.0f}, skipped {skipped:.0f}"
          + (f" (every save delayed {args.slow_disk:g} s)" if args.slow_disk else "")
          + "; per pair " + " ".join(f"{x:.3f}" for x in result["pair_ratios"]))
    (out / "restart.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"results file: {out / 'restart.json'}")
    print(_plot(result, out / "restart-bench.png"))
    print(f"restart-bench: warm_ttft_vs_cold={r1:.3f} save_throughput_vs_off={r2:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
