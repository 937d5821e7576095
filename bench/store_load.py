"""The headline load ratio alone (`load_vs_raw` at the 31.5 MiB part): `raw read` against
`galahad plain`, interleaved rounds, with the classes of bench/store.py, and variants of the read
slice and of the frame pool. A measurement behind docs/performance.md ("Seventh session"), not a
test.

    python bench/store_load.py                 # as shipped, 15 rounds
    python bench/store_load.py --slice-kib 256 # another read slice (`codec._slice_bytes`)
    python bench/store_load.py --no-pool       # T=2: every frame in its caller's thread
    python bench/store_load.py --no-recruit    # helpers only when a part starts (before the tenth session)
    python bench/store_load.py --python-loop   # frames read and hashed in Python, not by galahad._readhash
    python bench/store_load.py --step-kib 128  # the compiled loop's read size (`readhash.STEP`)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import store as sb  # noqa: E402

from galahad import codec, fanout, readhash  # noqa: E402

TOKENS = 224  # 31.5 MiB parts, the ratio line's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--slice-kib", type=int, default=0, help="read slice in KiB (default: as shipped)")
    ap.add_argument("--no-pool", action="store_true", help="at T=2, no frame pool")
    ap.add_argument("--no-recruit", action="store_true", help="cores freed while a part runs do not join it")
    ap.add_argument("--python-loop", action="store_true", help="no compiled read-and-hash loop")
    ap.add_argument("--step-kib", type=int, default=0, help="the compiled loop's read size in KiB")
    ap.add_argument("--dir", default=None, help="parent of the temp store folder")
    args = ap.parse_args()
    if args.python_loop:
        readhash._native = None
    if args.step_kib:
        readhash.STEP = args.step_kib << 10
    print(f"compiled read-and-hash loop: {'on, %d KiB reads' % (readhash.STEP >> 10) if readhash.available() else 'off'}",
          file=sys.stderr)
    if args.no_recruit:
        fanout._RECRUIT = False
    if args.slice_kib:
        codec._slices[:] = [args.slice_kib << 10]
    plan = sb.Plan((TOKENS,), TOKENS, 256 * sb.MiB, 128 * sb.MiB, args.rounds, 1)
    root = tempfile.mkdtemp(prefix="galahad-store-load-", dir=args.dir)
    try:
        runner = sb.Runner(plan, (1, 2), time.perf_counter())
        batch = sb.Batch(TOKENS, plan.count("load", TOKENS, 2), os.path.join(root, "part"))
        galahad = sb.Galahad(batch, (1, 2))
        imports = threading.Thread(target=sb._import_engines)
        imports.start()
        imports.join()
        others = sb.Others(batch, galahad)
        os.sync()
        for t in (2, 1):
            if args.no_pool and t == 2:
                galahad.services[("load", "plain", 2)]._frames = None
            runner.run(batch, [sb.Case("load", "raw read", t, others.raw_read_share()),
                               sb.Case("load", "galahad plain", t, galahad.load_share("plain", t)),
                               sb.Case("load", "galahad plain (Python loop)", t,
                                       sb.python_loop(galahad.load_share("plain", t)))])
            a = runner.results[("load", "galahad plain", TOKENS, t)]
            b = runner.results[("load", "raw read", TOKENS, t)]
            c = runner.results[("load", "galahad plain (Python loop)", TOKENS, t)]
            paired = statistics.median(x / y for x, y in zip(a["rounds"], b["rounds"]))
            paired_py = statistics.median(x / y for x, y in zip(c["rounds"], b["rounds"]))
            print(f"T={t}: galahad best {a['best']:.2f} median {a['median']:.2f} GB/s | raw best {b['best']:.2f} "
                  f"median {b['median']:.2f} GB/s | best ratio {a['best'] / b['best']:.2f} paired {paired:.2f}"
                  f" | Python loop best {c['best']:.2f} GB/s, ratio {c['best'] / b['best']:.2f} paired {paired_py:.2f}",
                  flush=True)
        galahad.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
