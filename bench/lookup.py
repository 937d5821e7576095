"""What one lookup costs vLLM's engine thread (issue 8): a chunk-order prompt of N 64-token entries,
all committed, looked up through a real `FilesystemBlockStore` (each entry: its commit marker read,
its part's size checked), and what the page-cache residency of a 300 MB part costs. A measurement
behind docs/performance.md, not a test.

    python bench/lookup.py                  # 80 entries (a 5k-token prompt), best of 5 x 100
    python bench/lookup.py --entries 200
    python bench/lookup.py --miss           # a layer-order prompt (the default order) that misses

A miss asks the store at every 16-token block end (127 times at 2k tokens, 2,047 at 32k), one
`lstat` of a commit marker each: `--miss` times that lookup at 2k, 8k and 32k tokens beside a
store of `--others` committed entries (their leaf folders exist, as in a used store), keys
derived apart from the probes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.codec import cipher_lookup
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.service import KVCacheService, SegmentSpec

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=80)
    ap.add_argument("--dir", default=None, help="parent of the temp store folder")
    ap.add_argument("--miss", action="store_true", help="time a layer-order lookup that misses")
    ap.add_argument("--others", type=int, default=3000, help="committed entries in the store (--miss)")
    args = ap.parse_args()
    if args.miss:
        _miss(args.others, args.dir)
        return
    root, svc = _service(args.dir, PayloadOrder.CHUNK)
    try:
        tokens = list(range(args.entries * 64 + 1))
        seed = svc.seed()
        keys = svc.keys(tokens, seed)
        segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
        for i in range(args.entries):
            key = keys[svc.chunking.key_index(64 * (i + 1))]
            svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segment, [bytes(2 * BLOCK * 4 * 4)])
            svc.commit(key)
        hit = svc.lookup(tokens, seed, keys=keys)
        if hit is None or len(hit.entries) != args.entries:
            raise SystemExit("lookup-bench: the committed prompt was not found whole")
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(100):
                svc.lookup(tokens, seed, keys=keys)
            best = min(best, (time.perf_counter() - t0) / 100)
        print(f"lookup-bench: entries={args.entries} ms_per_lookup={best * 1e3:.3f} "
              f"ms_per_residency_300MB={_residency_ms(root.parent):.3f}")
    finally:
        svc.close()
        shutil.rmtree(root.parent, ignore_errors=True)


def _service(parent: str | None, order: PayloadOrder) -> tuple[Path, KVCacheService]:
    """A plain service over a fresh store folder in a temp folder under `parent`, in `order`."""
    root = Path(tempfile.mkdtemp(prefix="galahad-lookup-", dir=parent)) / "store"
    root.mkdir(mode=0o700)
    ns = Namespace(model="lookup", model_fingerprint="lookup", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=order)
    check = Xxh3FrameCheck()
    return root, KVCacheService(namespace=ns, store=FilesystemBlockStore(root, ns, rescan_s=None),
                                chunking=Chunking(order, BLOCK), layout=RankLayout(), cipher=check,
                                ciphers=cipher_lookup(check))


def _miss(others: int, parent: str | None) -> None:
    """`--miss`: a layer-order prompt with no stored prefix, looked up beside `others` entries."""
    root, svc = _service(parent, PayloadOrder.LAYER)
    try:
        seed = svc.seed()
        stored = svc.keys(list(range(10**6, 10**6 + others * BLOCK)), seed)
        segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
        for i, key in enumerate(stored):
            svc.save_part(key, Span(0, BLOCK * (i + 1)), 0, segment, [bytes(2 * BLOCK * 4 * 4)])
            svc.commit(key)
        for length in (2048, 8192, 32768):
            tokens = list(range(length))
            keys_s = probes_s = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(10):
                    keys = svc.keys(tokens, seed)
                t1 = time.perf_counter()
                for _ in range(10):
                    if svc.lookup(tokens, seed, keys=keys) is not None:
                        raise SystemExit("lookup-bench: a prompt that was never stored was found")
                t2 = time.perf_counter()
                keys_s, probes_s = min(keys_s, (t1 - t0) / 10), min(probes_s, (t2 - t1) / 10)
            ends = len(svc.chunking.probe_ends(length))
            print(f"lookup-bench: miss tokens={length} probes={ends} ms_keys={keys_s * 1e3:.3f} "
                  f"ms_probes={probes_s * 1e3:.3f} us_per_probe={probes_s / ends * 1e6:.2f} others={others}")
    finally:
        svc.close()
        shutil.rmtree(root.parent, ignore_errors=True)


def _residency_ms(folder: Path) -> float:
    """What the cost model's page-cache question costs for one layer-order 2k-token part of an
    8B model (300 MB, in the page cache): `resident_share`, best of 5 x 100."""
    from galahad.adapters.fs.residency import resident_share

    path = folder / "part-300MB"
    path.write_bytes(bytes(300 << 20))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            resident_share(str(path))
        best = min(best, (time.perf_counter() - t0) / 100)
    return best * 1e3


if __name__ == "__main__":
    main()
