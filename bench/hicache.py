"""SGLang benchmark: how fast does Galahad serve SGLang's hierarchical cache (its L3 page functions),
in pages per second and GB/s, against SGLang's own file backend, `HiCacheFile`?

Both backends get the same pages of one real SGLang host pool (MHA, built on the CPU), through
the functions SGLang's controller uses for each: `HiCacheController._page_set_zero_copy` /
`_page_get_zero_copy` (Galahad, `interface_v1`) and `_generic_page_set` / `_generic_page_get`
(HiCacheFile, SGLang's copy path). Galahad verifies every page it returns (xxh3-128 per frame,
or AES-256-GCM with a key); HiCacheFile verifies nothing. Both stores sit in the same folder
tree on the same disk, and reads come from the page cache (the files were just written): this
measures the backends' own cost, not the disk's.

    python bench/hicache.py [--pages 32] [--rounds 5] [--layers 32] [--heads 8] [--head-dim 128]
                           [--page-size 64] [--layout page_first] [--lanes N] [--dir /tmp/x]
                           [--out DIR]

Defaults: 8 MiB pages (a Llama-3-8B-like page of 64 tokens at TP 1), 32 pages a call, the best
of 5 rounds in which the backends take turns (so load from other work hits all of them alike).
The table also gives read GB per CPU-second of the whole process (all threads): the cost, less
sensitive to a busy machine than wall time. The stores go to a temporary folder, removed at the
end (`--dir`: a folder of yours, kept); the figures (sglang.json) to `--out DIR`, default
bench/out/sglang-<YYYYmmdd-HHMMSS>/. docs/benchmarks.md ("SGLang") shows a run.

The last line is `sglang-bench: get_vs_hicachefile=R`: Galahad's read throughput in wall time
(checksummed, the default without a key) over HiCacheFile's (above 1: Galahad reads faster,
while verifying what it reads).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import logging
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "integration"))  # the tests' SGLang harness
from plot import run_folder  # noqa: E402 - after the path above
from sglang_support import harness, load_sglang  # noqa: E402 - after the path above


def _licence(folder: Path) -> dict[str, str]:
    from galahad.adapters.licence.issuer import generate_issuer, issue_licence, load_issuer_key

    private, public, _ = generate_issuer(folder / "issuer")
    lic = folder / "licence.lic"
    lic.write_bytes(issue_licence(load_issuer_key(private), "bench", 8, dt.date.today(), 1).encode())
    return {"GALAHAD_LICENCE_FILE": str(lic), "GALAHAD_LICENCE_ISSUER_KEY": str(public)}


def _controller(backend: Any, pool: Any, zero_copy: bool) -> SimpleNamespace:
    from sglang.srt.managers.cache_controller import HiCacheController

    ctl = harness.controller(backend, pool)
    ctl.page_set_func = functools.partial(
        HiCacheController._page_set_zero_copy if zero_copy else HiCacheController._generic_page_set, ctl)
    ctl.page_get_func = functools.partial(
        HiCacheController._page_get_zero_copy if zero_copy else HiCacheController._generic_page_get, ctl)
    return ctl


class _Lane:
    """One backend's share of the benchmark: its controller, host rows and best times."""

    def __init__(self, name: str, backend: Any, pool: Any, zero_copy: bool, pages: int) -> None:
        self.name, self.backend, self.pool = name, backend, pool
        self.ctl = _controller(backend, pool, zero_copy)
        self.src = pool.alloc(pages * pool.page_size)
        self.dst = pool.alloc(pages * pool.page_size)
        self.set_s: list[float] = []
        self.get_s: list[float] = []
        self.get_cpu: list[float] = []

    def round(self, r: int, pages: int) -> None:
        import torch

        ps = self.pool.page_size
        keys = harness.page_keys([t + 7919 * r for t in range(pages * ps)], ps)
        t0 = time.perf_counter()
        ok = self.ctl.page_set_func(keys, self.src)
        self.set_s.append(time.perf_counter() - t0)
        if not ok:
            raise SystemExit(f"{self.name}: writing pages failed")
        t0, c0 = time.perf_counter(), time.process_time()
        got = self.ctl.page_get_func(harness.operation(), keys, self.dst)
        self.get_s.append(time.perf_counter() - t0)
        self.get_cpu.append(time.process_time() - c0)
        if got != pages:
            raise SystemExit(f"{self.name}: read {got} of {pages} pages")
        for i in range(0, pages, max(1, pages // 8)):  # what came back is what went in
            a = self.pool.get_data_page(int(self.src[i * ps]), flat=True).view(torch.uint8)
            b = self.pool.get_data_page(int(self.dst[i * ps]), flat=True).view(torch.uint8)
            if not torch.equal(a, b):
                raise SystemExit(f"{self.name}: page {i} differs after the round trip")

    def row(self, pages: int, page_bytes: int) -> dict[str, Any]:
        best_set, best_get, best_cpu = min(self.set_s), min(self.get_s), min(self.get_cpu)
        return {"name": self.name, "set_pps": pages / best_set, "set_gbps": pages * page_bytes / best_set / 1e9,
                "get_pps": pages / best_get, "get_gbps": pages * page_bytes / best_get / 1e9,
                "get_cpu_gbps": pages * page_bytes / max(best_cpu, 1e-9) / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layout", default="page_first", choices=harness.LAYOUTS)
    parser.add_argument("--lanes", type=int, default=None, help="galahad_io_lanes (default: half the CPUs)")
    parser.add_argument("--dir", default=None, help="folder for both stores, kept (default: a temp folder, removed)")
    parser.add_argument("--out", default=None,
                        help="folder for the figures (default: bench/out/sglang-<YYYYmmdd-HHMMSS>)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a busy machine OpenMP spinning swamps both)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = run_folder("sglang", args.out)
    base = Path(args.dir or tempfile.mkdtemp(prefix="galahad-sglang-bench-"))
    try:
        rows, page_bytes = measure(args, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report(args, rows, page_bytes, out)
    return 0


def measure(args: argparse.Namespace, base: Path) -> tuple[list[dict[str, Any]], int]:
    """Both backends' rows (HiCacheFile, Galahad checksummed, Galahad sealed), stores under `base`."""
    load_sglang()
    import torch

    torch.set_num_threads(args.torch_threads)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    base.mkdir(parents=True, exist_ok=True)
    licence = _licence(base)
    pool = harness.make_pool("mha", args.layout, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                             page_size=args.page_size, capacity=6 * args.pages * args.page_size)
    harness.fill_random(pool, seed=1)
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    lanes = [_Lane("HiCacheFile (no check)",
                   HiCacheFile(harness.storage_config(extra={"file_storage_path": str(base / "hicachefile")})),
                   pool, False, args.pages)]
    for label, key in (("Galahad xxh3-128", None), ("Galahad AES-256-GCM", base / "store.key")):
        os.environ.update(licence, GALAHAD_CACHE_DIR=str(base / label.split()[1]))
        os.environ.pop("GALAHAD_KEY_FILE", None)
        if key is not None:
            os.environ["GALAHAD_KEY_FILE"] = str(key)
        extra = {} if args.lanes is None else {"galahad_io_lanes": args.lanes}
        backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(extra=extra), pool)
        backend.register_mem_pool_host(pool)
        if not backend.enabled:
            raise SystemExit(f"Galahad did not enable: {backend.reason}")
        lanes.append(_Lane(label, backend, pool, True, args.pages))
    for r in range(args.rounds):  # interleaved, so load from elsewhere hits every backend alike
        for lane in lanes:
            lane.round(r, args.pages)
    rows = [lane.row(args.pages, page_bytes) for lane in lanes]
    for lane in lanes[1:]:
        lane.backend.close()
    return rows, page_bytes


def report(args: argparse.Namespace, rows: list[dict[str, Any]], page_bytes: int, out: Path) -> None:
    """The table, the figures file and, last, the ratio line."""
    print(f"pages: {args.pages} a call, best of {args.rounds} interleaved rounds, {page_bytes / 2**20:.2f} MiB a page "
          f"({args.layers} layers, {args.heads} heads x {args.head_dim}, {args.page_size} tokens, bf16, "
          f"{args.layout}), {os.cpu_count()} CPUs, page cache warm")
    print(f"{'backend':<24} {'set pages/s':>12} {'set GB/s':>9} {'get pages/s':>12} {'get GB/s':>9} "
          f"{'get GB/CPU-s':>13}")
    for r in rows:
        print(f"{r['name']:<24} {r['set_pps']:>12.0f} {r['set_gbps']:>9.2f} {r['get_pps']:>12.0f} "
              f"{r['get_gbps']:>9.2f} {r['get_cpu_gbps']:>13.2f}")
    ratio = rows[1]["get_gbps"] / rows[0]["get_gbps"]
    sealed = rows[2]["get_gbps"] / rows[0]["get_gbps"]
    print(f"Galahad AES-256-GCM get vs HiCacheFile: {sealed:.2f}; per CPU second, xxh3-128: "
          f"{rows[1]['get_cpu_gbps'] / rows[0]['get_cpu_gbps']:.2f}, AES-256-GCM: "
          f"{rows[2]['get_cpu_gbps'] / rows[0]['get_cpu_gbps']:.2f}")
    (out / "sglang.json").write_text(json.dumps(dict(
        pages=args.pages, rounds=args.rounds, page_bytes=page_bytes, layout=args.layout, cpus=os.cpu_count(),
        rows=rows, get_vs_hicachefile=ratio), indent=1))
    print(f"results file: {out / 'sglang.json'}")
    print(f"sglang-bench: get_vs_hicachefile={ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
