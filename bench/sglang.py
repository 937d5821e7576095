"""Pages per second and GB/s through SGLang's L3 page functions: Galahad vs SGLang's `HiCacheFile`.

Both backends get the same pages of one real SGLang host pool (MHA, built on the CPU), through
the functions SGLang's controller uses for each: `HiCacheController._page_set_zero_copy` /
`_page_get_zero_copy` (Galahad, `interface_v1`) and `_generic_page_set` / `_generic_page_get`
(HiCacheFile, SGLang's copy path). Galahad verifies every page it returns (xxh3-128 per frame,
or AES-256-GCM with a key); HiCacheFile verifies nothing. Both stores sit in the same folder
tree on the same disk, and reads come from the page cache (the files were just written): this
measures the backends' own cost, not the disk's.

    python bench/sglang.py [--pages 128] [--rounds 3] [--layers 8] [--heads 4] [--head-dim 128]
                           [--page-size 64] [--layout page_first] [--dir /tmp/x]

The last line is `sglang-bench: get_vs_hicachefile=R`: Galahad's read throughput (checksummed,
the default without a key) over HiCacheFile's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# This file is named sglang.py: drop its own folder from the path, or `import sglang` finds it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests" / "integration"))

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


def _run(name: str, backend: Any, pool: Any, zero_copy: bool, args: argparse.Namespace,
         page_bytes: int) -> dict[str, Any]:
    import torch

    ctl = _controller(backend, pool, zero_copy)
    src = pool.alloc(args.pages * pool.page_size)
    dst = pool.alloc(args.pages * pool.page_size)
    set_s = get_s = 0.0
    for r in range(args.rounds):
        keys = harness.page_keys([t + 7919 * r for t in range(args.pages * pool.page_size)], pool.page_size)
        t0 = time.perf_counter()
        ok = ctl.page_set_func(keys, src)
        set_s += time.perf_counter() - t0
        if not ok:
            raise SystemExit(f"{name}: writing pages failed")
        t0 = time.perf_counter()
        got = ctl.page_get_func(harness.operation(), keys, dst)
        get_s += time.perf_counter() - t0
        if got != args.pages:
            raise SystemExit(f"{name}: read {got} of {args.pages} pages")
    for i in range(0, args.pages, max(1, args.pages // 8)):  # what came back is what went in
        a = pool.get_data_page(int(src[i * pool.page_size]), flat=True).view(torch.uint8)
        b = pool.get_data_page(int(dst[i * pool.page_size]), flat=True).view(torch.uint8)
        if not torch.equal(a, b):
            raise SystemExit(f"{name}: page {i} differs after the round trip")
    pool.free(src)
    pool.free(dst)
    n = args.pages * args.rounds
    return {"name": name, "set_pps": n / set_s, "set_gbps": n * page_bytes / set_s / 1e9,
            "get_pps": n / get_s, "get_gbps": n * page_bytes / get_s / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layout", default="page_first", choices=harness.LAYOUTS)
    parser.add_argument("--dir", default=None, help="folder for both stores (default: a temp folder)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    load_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    base = Path(args.dir or tempfile.mkdtemp(prefix="galahad-sglang-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    licence = _licence(base)
    pool = harness.make_pool("mha", args.layout, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                             page_size=args.page_size, capacity=2 * args.pages * args.page_size)
    harness.fill_random(pool, seed=1)
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    rows = []
    reference = HiCacheFile(harness.storage_config(extra={"file_storage_path": str(base / "hicachefile")}))
    rows.append(_run("HiCacheFile (no check)", reference, pool, False, args, page_bytes))
    for label, key in (("Galahad xxh3-128", None), ("Galahad AES-256-GCM", base / "store.key")):
        os.environ.update(licence, GALAHAD_CACHE_DIR=str(base / label.split()[1]))
        os.environ.pop("GALAHAD_KEY_FILE", None)
        if key is not None:
            os.environ["GALAHAD_KEY_FILE"] = str(key)
        backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(), pool)
        backend.register_mem_pool_host(pool)
        if not backend.enabled:
            raise SystemExit(f"Galahad did not enable: {backend.reason}")
        rows.append(_run(label, backend, pool, True, args, page_bytes))
        backend.close()

    print(f"pages: {args.pages} x {args.rounds} rounds, {page_bytes / 2**20:.2f} MiB a page "
          f"({args.layers} layers, {args.heads} heads x {args.head_dim}, {args.page_size} tokens, bf16, "
          f"{args.layout}), {os.cpu_count()} CPUs, page cache warm")
    print(f"{'backend':<24} {'set pages/s':>12} {'set GB/s':>9} {'get pages/s':>12} {'get GB/s':>9}")
    for r in rows:
        print(f"{r['name']:<24} {r['set_pps']:>12.0f} {r['set_gbps']:>9.2f} {r['get_pps']:>12.0f} {r['get_gbps']:>9.2f}")
    ratio = rows[1]["get_gbps"] / rows[0]["get_gbps"]
    sealed = rows[2]["get_gbps"] / rows[0]["get_gbps"]
    print(f"Galahad AES-256-GCM get vs HiCacheFile: {sealed:.2f}")
    print(f"sglang-bench: get_vs_hicachefile={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
