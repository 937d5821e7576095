"""How much Galahad's save threads slow the engine's thread (issue 8), on the CPU: the engine's
thread makes small torch calls (each lets go of the interpreter lock and takes it back, as
vLLM's engine thread does at every kernel launch) while N threads save Qwen3-8B-shaped 9.4 MB
parts through a real `KVCacheService` and `FilesystemBlockStore` (36 layers, 64 tokens a part,
plain), the payload in shared memory as the CUDA path gathers it. With `--processes P`, P save
processes (GALAHAD_SAVE_PROCESSES) seal and write the parts instead of the threads. A
measurement behind docs/performance.md ("Twelfth session", "Thirteenth session"), not a test.

    python bench/convoy.py                         # 0, 1, 2, 4, 8, 16 save threads, store in /dev/shm
                                                   # (a few GB written a count, removed after it)
    python bench/convoy.py --threads 0,2,8 --processes 0,4 --dir /var/tmp --png convoy.png

It prints a table (seconds for the engine's calls, that against no saves, how long of it the
engine's thread slept waiting for the interpreter lock (from /proc/thread-self/schedstat: what
is neither running nor waiting for a core), parts saved a second) and one line
`convoy-bench: slowdown_<N>=R asleep_ms_<N>=T ...` (`<N>_p<P>` with several --processes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.reader_pool import HelperRecipe, ReaderPool, SharedRegion  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

BLOCK, LAYERS = 16, 36
SHAPE = (4, 2 * BLOCK, 8, 128)  # a 64-token part of one layer: 4 blocks, K and V, 8 heads of 128
CALLS = 20_000


def _sched() -> tuple[float, float] | None:
    """(CPU seconds, seconds runnable but waiting for a core) of the calling thread so far, from
    /proc/thread-self/schedstat; None where the kernel keeps no such figures."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _slices = f.read().split()
    except (OSError, ValueError):
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def _engine() -> tuple[float, float | None]:
    """The engine thread's stand-in: CALLS small torch calls. (Seconds, of which asleep: neither
    running nor waiting for a core, that is waiting for the interpreter lock; None without
    schedstat.) On this 2-core machine the savers also take the cores from the engine's thread
    (the rest of the difference); with cores to spare (the H200 machine has 16) the lock wait is
    what is left."""
    before = _sched()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        torch.empty(0, dtype=torch.bfloat16)
    wall = time.perf_counter() - t0
    after = _sched()
    if before is None or after is None:
        return wall, None
    return wall, max(0.0, wall - (after[0] - before[0]) - (after[1] - before[1]))


def _service(root: Path, threads: int) -> KVCacheService:
    ns = Namespace(model="convoy", model_fingerprint="convoy", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    store = FilesystemBlockStore(root, ns, rescan_s=None, max_bytes=64 << 30)
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check),
                          io_threads=max(1, threads))


def measure(folder: str, threads: int, rounds: int, processes: int = 0) -> tuple[float, float | None, float]:
    """(best engine seconds over `rounds`, the least time asleep of a round, parts saved a second
    meanwhile) with `threads` savers. `processes`: that many save processes seal and write the
    parts (GALAHAD_SAVE_PROCESSES), from a shared region as on the GPU; the threads only hand
    them over and place the files."""
    root = Path(tempfile.mkdtemp(prefix="galahad-convoy-", dir=folder)) / "store"
    root.mkdir(mode=0o700)
    svc = _service(root, threads)
    tokens = list(range(64 * 20_000 + 1))
    keys = svc.keys(tokens, svc.seed())
    segments = tuple(SegmentSpec(0, i, 0, "bfloat16", SHAPE) for i in range(LAYERS))
    nbytes = 4 * 2 * BLOCK * 8 * 128 * 2
    region = SharedRegion(nbytes * LAYERS)  # one part's segments back to back, as gathered on a GPU
    payload = [region.view[i * nbytes : (i + 1) * nbytes] for i in range(LAYERS)]
    if processes:
        svc.attach_writers(ReaderPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)),
                                      processes, writes=True))
    at = 0 if processes else None
    nxt, lock, stop = [0], threading.Lock(), threading.Event()

    def saver() -> None:
        while not stop.is_set():
            with lock:
                i = nxt[0]
                nxt[0] += 1
            svc.save_part(keys[i], Span(64 * i, 64 * (i + 1)), 0, segments, payload, region_offset=at)

    workers = [threading.Thread(target=saver, daemon=True) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        time.sleep(0.5 if threads else 0)
        best, asleep, rates = float("inf"), [], []
        for _ in range(rounds):
            c0, t0 = nxt[0], time.perf_counter()
            wall, waited = _engine()
            best = min(best, wall)
            if waited is not None:
                asleep.append(waited)
            rates.append((nxt[0] - c0) / (time.perf_counter() - t0))
        return best, min(asleep) if asleep else None, max(rates) if threads else 0.0
    finally:
        stop.set()
        for w in workers:
            w.join()
        svc.close()
        shutil.rmtree(root.parent, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="0,1,2,4,8,16", help="save thread counts, comma-separated")
    ap.add_argument("--processes", default="0",
                    help="save process counts to try each thread count with, comma-separated "
                         "(0: the threads seal and write, as by default; e.g. 0,4)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="parent of the temp store folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = ap.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    procs = [int(x) for x in args.processes.split(",")]
    rows = []
    for n in counts:
        for p in procs if n else [0]:
            seconds, asleep, rate = measure(args.dir, n, args.rounds, p)
            rows.append((n, p, seconds, asleep, rate))
            shown = "" if asleep is None else f" ({asleep * 1e3:.1f} asleep)"
            print(f"  {n:2d} save threads, {p} save processes: engine {seconds:.3f} s{shown}, "
                  f"{rate:.0f} parts/s", flush=True)
    base = next((r[2] for r in rows if r[0] == 0), rows[0][2])
    print(f"\n| save threads | save processes | engine's {CALLS} torch calls, s | against no saves "
          "| asleep (waiting for the interpreter lock), ms | parts saved / s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, p, seconds, asleep, rate in rows:
        shown = "" if asleep is None else f"{asleep * 1e3:.1f}"
        print(f"| {n} | {p} | {seconds:.3f} | {seconds / base:.1f} | {shown} | {rate:.0f} |")
    line = []
    for n, p, seconds, asleep, _rate in rows:
        tag = f"{n}" if len(procs) == 1 else f"{n}_p{p}"
        line.append(f"slowdown_{tag}={seconds / base:.1f}")
        if asleep is not None and n:
            line.append(f"asleep_ms_{tag}={asleep * 1e3:.0f}")
    print("convoy-bench: " + " ".join(line))
    if args.png:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot import Panel, grouped_bars_figure

        labels = [str(n) for n in counts if n]

        def series(pick: int, scale: float = 1.0, of_base: bool = False) -> dict[str, list[float | None]]:
            out: dict[str, list[float | None]] = {}
            for p in procs:
                name = "save threads write" if p == 0 else f"{p} save processes write"
                vals = []
                for n in counts:
                    if n:
                        r = next(r for r in rows if r[0] == n and r[1] == p)
                        v = r[pick]
                        vals.append(None if v is None else (v / base if of_base else v * scale))
                out[name] = vals
            return out

        grouped_bars_figure([
            Panel("engine thread, against no saves", labels, series(2, of_base=True), ylabel="x"),
            Panel("engine thread asleep (the interpreter lock)", labels, series(3, 1e3), ylabel="ms"),
            Panel("parts saved a second", labels, series(4), ylabel="parts/s"),
        ], args.png, columns=1, suptitle="save threads and save processes (bench/convoy.py)")
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
