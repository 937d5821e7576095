"""What host-to-device copies do to a load's reads on the GPU machine, from `bench/worker_load.py
--layer-tokens N --dma` output: `load_part` alone (16 frame threads into a pinned buffer), the same
while another pinned buffer is copied to the GPU all along (`alone+h2d`), and the worker's load
streamed into a real paged KV cache (`stream`, what ships) or read whole and copied after
(`whole`). A measurement behind docs/performance.md ("Twenty-seventh session"), not a test.

    python bench/gpu_contention.py bench/results/s27/call3-wl2k.txt bench/results/s27/call3-wl32k.txt \\
        --png docs/img/gpu-contention-s27.png

Prints one table row per length and cipher and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot import Panel, grouped_bars_figure  # noqa: E402

CASES = ("alone", "alone+h2d", "stream", "whole")


def rows(paths: list[Path]) -> list[dict[str, object]]:
    """The `layer_N` RESULT lines of worker_load's output files, in order."""
    found = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("RESULT "):
                row = json.loads(line[len("RESULT "):])
                if str(row.get("name", "")).startswith("layer_"):
                    found.append(row)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--png", default="gpu-contention.png")
    args = ap.parse_args()
    found = rows(args.files)
    if not found:
        print("no worker_load layer results in these files", file=sys.stderr)
        return 1
    print("| load | " + " | ".join(CASES) + " | copies alone / beside the reads |")
    print("| --- |" + " ---: |" * (len(CASES) + 1))
    panels = []
    for kind in ("plain", "sealed"):
        cats, series = [], {case: [] for case in CASES}  # type: dict[str, list[float | None]]
        for row in found:
            label = f"{row['tokens']} x {row['jobs']}"
            cats.append(label)
            cells = []
            for case in CASES:
                gbs, ms = row.get(f"{kind}_{case}_gbs"), row.get(f"{kind}_{case}_ms")
                series[case].append(gbs)  # type: ignore[arg-type]
                cells.append("-" if gbs is None else f"{gbs} GB/s ({ms} ms)")
            h2d = f"{row.get(f'{kind}_h2d_alone_gbs', '-')} / {row.get(f'{kind}_h2d_beside_gbs', '-')} GB/s"
            print(f"| {kind}, {label} tokens | " + " | ".join(cells) + f" | {h2d} |")
        panels.append(Panel(f"{kind} parts: GB/s of payload", cats, series))
    print(f"plot: {grouped_bars_figure(panels, args.png, columns=2, suptitle='bench/worker_load.py --dma on one H200')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
