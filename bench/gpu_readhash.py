"""The compiled read-and-verify loop against the Python one on the GPU machine, from `bench/gpu.py`
results: the load bandwidth of a restarted engine reading at the request (`load-plain~nopreload`
against `load-plain~nopreload~py`: bytes over the time in `start_load_kv`), as a share of the
medium (`loadpath`'s 16 threads of `preadv` on the same machine). A measurement behind
docs/performance.md ("Twenty-sixth session"), not a test.

    python bench/gpu_readhash.py bench/results/s26/call1.jsonl bench/results/s26/call2.jsonl \\
        bench/results/s26/call3.jsonl --png docs/img/gpu-readhash-s26.png

A file's runs use the medium measured in it; a file without one (call 2) takes the next file's
(call 3 ran on the same machine). Prints one table row per run and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot import Panel, grouped_bars_figure  # noqa: E402

KV_PER_TOKEN = 36 * 2 * 8 * 128 * 2  # Qwen3-8B shape, bf16
LOADS = {2048: 5, 32768: 1}  # prompts per length in bench/gpu.py
MODES = {"load-plain~nopreload": "compiled", "load-plain~nopreload~py": "Python"}


def runs(path: Path) -> tuple[list[tuple[str, dict[int, float]]], dict[int, float]]:
    """The (loop, {tokens: seconds in start_load_kv}) of each load mode run in `path`, in order,
    and the medium's GB/s per length (empty if `path` has no `loadpath`)."""
    found: list[tuple[str, dict[int, float]]] = []
    medium: dict[int, float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        mode, name = row.get("mode", ""), row.get("name", "")
        if mode == "loadpath" and name.startswith("loadpath_"):
            medium[row["tokens"]] = row["raw_all_gbs"]
        elif mode in MODES and name.startswith("hooks_"):
            tokens = int(name.removeprefix("hooks_"))
            if tokens == min(LOADS) or not found or tokens in found[-1][1]:
                found.append((MODES[mode], {}))
            found[-1][1][tokens] = row["start_load_kv"] / 1e3
    return found, medium


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--png", default="docs/img/gpu-readhash-s26.png")
    args = ap.parse_args()
    parsed = [runs(p) for p in args.results]
    media = [m for _, m in parsed]
    for i, m in enumerate(media):  # a file without its own medium: the next one's (the same machine)
        if not m:
            media[i] = next((n for n in media[i + 1 :] if n), {})
    share: dict[str, dict[int, list[float]]] = {loop: {n: [] for n in LOADS} for loop in MODES.values()}
    print("| run | loop | " + " | ".join(f"{n} tokens: ms, share of the medium" for n in LOADS) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in LOADS) + " |")
    for path, (found, _), medium in zip(args.results, parsed, media):
        for loop, seconds in found:
            cells = []
            for n, count in LOADS.items():
                if n not in seconds or n not in medium:
                    cells.append("n/a")
                    continue
                ratio = count * n * KV_PER_TOKEN / seconds[n] / 1e9 / medium[n]
                share[loop][n].append(ratio)
                cells.append(f"{seconds[n] * 1e3:.1f} ({ratio:.2f})")
            print(f"| {path.stem} | {loop} | " + " | ".join(cells) + " |")
    panels = [Panel(f"{n} tokens: load read at the request", [f"run {i + 1}" for i in range(max(map(len, (share[l][n] for l in share))))],
                    {f"{loop} loop": values for loop, values in ((l, share[l][n]) for l in share)},
                    ylabel="GB/s into the KV cache / medium") for n in LOADS]
    for panel in panels:  # pad the shorter series so the bars line up
        width = len(panel.categories)
        panel.series = {k: v + [None] * (width - len(v)) for k, v in panel.series.items()}
    grouped_bars_figure(panels, args.png, columns=2,
                        suptitle="H200, vLLM 0.26: start_load_kv bandwidth over the medium (target 0.8)")
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
