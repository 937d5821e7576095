"""Where threads spend their samples (or who holds the interpreter lock, with --gil), summed from py-spy's raw output (`py-spy record --gil --threads
-f raw`): samples by thread (name without its trailing number) and, in each, the functions on top
of the stack. A reading aid for the GPU leases (docs/performance.md), not a test.

    py-spy record --threads --native -r 200 -f raw -o spy.txt -- python3 bench/gpu.py ...
    python bench/spy.py spy.txt            # top 12 functions per thread
    python bench/spy.py spy.txt --only MainThread --under wait_for_save --top 30 --depth 4
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_THREAD = re.compile(r"^thread \(\d+\): ([^;]*);?(.*) (\d+)$")


def _group(name: str) -> str:
    return re.sub(r"[_-]?\d+$", "", name) or name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--depth", type=int, default=1, help="frames from the top of the stack shown")
    ap.add_argument("--only", default=None, help="this thread (name without its number) only")
    ap.add_argument("--under", default=None, help="only stacks with a frame containing this text")
    ap.add_argument("--inner", default=None, help="group by the innermost frame containing this "
                    "text (e.g. galahad/) and the frame on top of the stack")
    args = ap.parse_args()
    threads: Counter[str] = Counter()
    tops: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    with open(args.raw, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _THREAD.match(line.rstrip("\n"))
            if m is None:
                continue
            name, stack, count = _group(m.group(1)), m.group(2), int(m.group(3))
            if (args.only and name != args.only) or (args.under and args.under not in stack):
                continue
            frames = [fr for fr in stack.split(";") if fr]
            top = " < ".join(reversed(frames[-args.depth:])) if frames else "(no Python frame)"
            if args.inner:
                inner = [fr for fr in frames if args.inner in fr]
                top = f"{inner[-1] if inner else '-'} | {frames[-1] if frames else '-'}"
            threads[name] += count
            tops[name][top] += count
            total += count
    print(f"spy: {total} samples")
    for name, n in threads.most_common():
        print(f"== {name}: {n} samples ({100 * n / max(total, 1):.1f}%)")
        for top, k in tops[name].most_common(args.top):
            print(f"   {k:7d}  {top[:220]}")


if __name__ == "__main__":
    main()
