"""The vLLM worker's load path alone, on a GPU, without vLLM's engine: how fast a step of sync load
jobs lands in a real paged KV cache, and where the engine thread's time goes.

    python bench/worker_load.py [--jobs 4] [--entries 52] [--steps 8] [--variants a,b,...]
    python bench/worker_load.py --layer-tokens 2048,32768     # one entry a job, plain and sealed
    python bench/worker_load.py --layer-tokens 2048 --phases  # and where a streamed step's time goes

A real store (chunk order, Qwen3-8B shape: 36 layers, 64 KiB pages, 9.4 MB a 64-token entry) is
written through the worker's own save path, page cache warm; each step is `--jobs` sync load jobs
of `--entries` entries (the multi-turn benchmark's step: four conversations of about 3,300
tokens), timed from `start_load` until the copies have landed on the device. Variants:

    readers   reader processes (--readers, 8 as vLLM's worker starts them on 16 cores) read
    threads   no reader processes: the worker's threads read (GALAHAD_READER_PROCESSES=0)
    switch    `readers` with the interpreter's switch interval at 0.5 ms (5 ms by default)
    busy      `readers` while the save threads write other entries (a save backlog)
    yieldN    with `busy`: each save first waits, at most N ms, while a load runs
              (GALAHAD_SAVE_YIELD_MS=N; off by default)
    async     `readers`, the jobs asynchronous (read on the I/O pool, copied in when all is read)
    readonly  `readers`, the entries read but not copied in (the reads' own rate)
    stream    with `readonly`: all jobs' entries in one read-ahead
    sliceK    the reader processes read K KiB of a frame per read (512 by default)
    batchN, aheadN   `readers` with N entries a copy, N entries read at once (and N readers)
    eager     the copies' placing kernels launched one by one, not replayed as CUDA graphs (the
              load path before the ninth session)
    a+b       both (e.g. readonly+stream)

Each variant prints (a RESULT line, then a table) its GB/s of payload into the KV cache, the
engine thread's time waiting for reads and in the copies (host time of `_scatter_parts`); then one
line `worker-load: ...`. Needs CUDA (without it the CPU byte path runs: a smoke run of the script
only); the figures are in docs/performance.md (eighth session), not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.adapters.vllm import worker as w
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, LoadJob, SaveJob
from galahad.codec import cipher_lookup
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Chunking
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad import reader_pool
from galahad.reader_pool import HelperRecipe
from galahad.service import KVCacheService

LAYERS, BLOCK, HEADS, HEAD = 36, 16, 8, 128  # Qwen3-8B: 64 KiB a layer's page of 16 tokens
ENTRY_BLOCKS = 4  # 64 tokens an entry (chunk order)


def emit(name: str, **fields: Any) -> None:
    print("RESULT " + json.dumps({"mode": "worker-load", "name": name, **fields}), flush=True)


def _config(num_blocks: int) -> SimpleNamespace:
    names = [f"layer.{i}" for i in range(LAYERS)]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(layer_names=names)])


def _caches(num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.randn(num_blocks, 2, BLOCK, HEADS * HEAD, dtype=torch.bfloat16, device=device)
            for i in range(LAYERS)}


def _service(root: Path, ns: Namespace, readers: int) -> KVCacheService:
    check = Xxh3FrameCheck()
    store = FilesystemBlockStore(root, ns, max_bytes=1 << 40, rescan_s=None)
    store.wait_indexed(60)
    cores = len(os.sched_getaffinity(0))
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check), io_threads=8,
                          frame_threads=cores, reader_processes=readers,
                          helper_recipe=HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)))


class _Clock:
    """The engine thread's host time waiting for reads and in `_scatter_parts`, per step: the
    differences of bench/gpu.py's load trace (`_trace_loads` wraps the worker's methods)."""

    def __init__(self) -> None:
        from gpu import _trace_loads  # bench/gpu.py, beside this script

        self._trace = _trace_loads()
        self._seen = (0.0, 0)

    def take(self) -> tuple[float, float, int]:
        """(wait s, copy s, copy calls) since the last call."""
        wait, calls = self._trace.wait_s, len(self._trace.copy_s)
        copy = sum(self._trace.copy_s[self._seen[1]:])
        out = (wait - self._seen[0], copy, calls - self._seen[1])
        self._seen = (wait, calls)
        return out


def scatter_alone(worker: w.GalahadWorker, entries: list[EntryRef], reps: int = 10) -> dict[str, float]:
    """`scatter_many` of `worker._batch` entries, nothing read: the host time of the call and the
    time until the copies landed, from the shared region (registered with CUDA by the worker) and
    from buffers torch pinned itself."""
    cuda = worker.cuda
    if cuda is None:
        return {}
    batch = entries[: worker._batch]
    nrows = ENTRY_BLOCKS
    n = cuda.payload_bytes(nrows)
    out: dict[str, float] = {}
    for kind in ("region", "pinned"):
        bufs = [cuda.pool.acquire(n, shared=True) if kind == "region"
                else w.PinnedBuffer(torch.empty(n, dtype=torch.uint8, pin_memory=True)) for _ in batch]
        if any(b is None for b in bufs):
            continue
        pieces = [w.Piece(e.blocks, b.view(n), nrows, 0) for e, b in zip(batch, bufs)]  # type: ignore[union-attr]
        host, total = [], []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cuda.scatter_many(pieces)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        nbytes = n * len(batch)
        out[f"{kind}_host_ms"] = round(statistics.median(host[1:]) * 1e3, 2)
        out[f"{kind}_gbs"] = round(nbytes / statistics.median(total[1:]) / 1e9, 1)
        out[f"{kind}_pinned"] = bool(bufs[0].tensor.is_pinned())  # type: ignore[union-attr]
        if kind == "region":
            for b in bufs:
                cuda.pool.release(b)  # type: ignore[arg-type]
    out["entries"] = len(batch)
    return out


def load(worker: w.GalahadWorker, meta: GalahadMetadata, read_only: bool = False, stream: bool = False) -> None:
    """A step's loads, as the engine runs them: sync jobs inside `start_load`; async ones read on
    the I/O pool, then copied in on this thread (`transfer_results`, as `get_finished` does).
    `read_only`: each job's entries read as `start_load` reads them, nothing copied in; with
    `stream`, every job's entries in one read-ahead (no job waits for the one before to drain)."""
    if read_only:
        groups = [tuple(e for job in meta.loads for e in job.entries)] if stream else [j.entries for j in meta.loads]
        for entries in groups:
            for _reason, part in worker._read_ahead(entries):
                if part is not None:
                    worker._return_leases([part])
        for job in meta.loads:
            worker._report.loaded.setdefault(job.req_id, []).append((0, None))
        return
    worker.start_load(meta)
    if any(job.async_load for job in meta.loads):
        worker.wait_idle()
        worker.transfer_results()


class _Phases:
    """Wall time summed per function over the calls made while it is active (calls on other
    threads overlap each other and the step: a sum, not a share of the step)."""

    _TARGETS = (("galahad.adapters.vllm.worker", "GalahadWorker", ("_acquire", "_read_entry", "_finish", "_check",
                                                                    "_take_preloaded", "_take_held")),
                ("galahad.adapters.vllm.cuda", "CudaBlockTransfer", ("stream_in", "_index")),
                ("galahad.adapters.vllm.cuda", "StreamIn", ("advance", "_issue", "finish")),
                ("galahad.service", "KVCacheService", ("load_part",)),
                ("galahad.codec", None, ("_checked_head", "_read_tags", "open_part_from")))

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.totals[name] = self.totals.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + 1

    def __enter__(self) -> "_Phases":
        import importlib

        for module, cls, names in self._TARGETS:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            for name in names:
                real = getattr(owner, name, None)
                if real is None:
                    continue
                label = f"{cls or module.rpartition('.')[2]}.{name}"

                def timed(*a: Any, _real: Any = real, _label: str = label, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _real(*a, **k)
                    finally:
                        self.add(_label, time.perf_counter() - t0)

                self._undo.append((owner, name, real))
                setattr(owner, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


class _H2DLoop:
    """Inside `with`: a thread copying one pinned buffer of `nbytes` to the GPU over and over, on a
    stream of its own (what a streamed load's copies do beside its reads, without the load)."""

    def __init__(self, nbytes: int) -> None:
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self._stream = torch.cuda.Stream()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._copied, self._seconds = 0, 0.0

    def _run(self) -> None:
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            while not self._stop.is_set():
                self._dev.copy_(self._host, non_blocking=True)
                self._stream.synchronize()
                self._copied += self._host.numel()
        self._seconds += time.perf_counter() - t0

    def __enter__(self) -> _H2DLoop:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def rate(self) -> float:
        """GB/s copied while it ran beside the reads."""
        return self._copied / self._seconds / 1e9 if self._seconds else 0.0

    def alone(self, seconds: float = 0.5) -> float:
        """GB/s of the same copies with nothing beside them."""
        copied, spent = self._copied, self._seconds
        with self:
            time.sleep(seconds)
        rate = (self._copied - copied) / (self._seconds - spent) / 1e9
        return rate


def layer_mode(work: Path, tokens: int, device: str, reps: int = 5, phases: bool = False, jobs: int = 1,
               dma: bool = False, frame_kib: int = 0) -> None:
    """A step of `jobs` sync jobs of one entry of `tokens` tokens each (layer order: what restarted
    prompts load), plain and sealed (AES-GCM, the cipher's default OpenSSL path): `load_part` alone
    into a pinned buffer (16 frame threads; the jobs' entries one after another), the same while
    another pinned buffer is copied to the GPU over and over on a stream of its own (`alone+h2d`:
    what a load's own host-to-device copies do to its reads, with `dma`), the worker's load copied
    in layer by layer as its frames verify (`stream`: the shipped path), and the worker reading
    each whole, then copying it in once (`whole`). GB/s of payload, median of `reps`."""
    from galahad.adapters.crypto.aesgcm import AesGcmCipher
    from galahad.domain.secret import SecretKey

    ns = Namespace(model="wl", model_fingerprint="wl", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=PayloadOrder.LAYER)
    per_job = tokens // BLOCK
    num_blocks = jobs * per_job + 16
    caches = _caches(num_blocks, device)
    cores = len(os.sched_getaffinity(0))
    row: dict[str, float] = {}
    for kind in ("plain", "sealed"):
        cipher: Any = Xxh3FrameCheck() if kind == "plain" else AesGcmCipher(SecretKey(os.urandom(32)))
        root = work / f"layer-{kind}"
        root.mkdir(parents=True, exist_ok=True)
        store = FilesystemBlockStore(root, ns, max_bytes=1 << 40, rescan_s=None)
        store.wait_indexed(60)
        svc = KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.LAYER, BLOCK),
                             layout=RankLayout(), cipher=cipher, ciphers=cipher_lookup(cipher), io_threads=8,
                             frame_threads=cores)
        if frame_kib:  # parts saved with frames of this size (4 MiB by default)
            svc.frame_size = frame_kib << 10
        entries = []
        for j in range(jobs):
            ids = [(j * 100_003 + i * 7919) % 150_000 for i in range(tokens + 1)]
            keys = svc.keys(ids, svc.seed())
            span = svc.chunking.save_spans(tokens)[0]
            base = j * per_job
            entries.append(EntryRef(keys[svc.chunking.key_index(span.end)].raw, span.start, span.end,
                                    (tuple(range(base + span.start // BLOCK, base + span.end // BLOCK)),)))
        worker = w.GalahadWorker(svc, 0, RankLayout(), _config(num_blocks), BLOCK)
        worker.register(caches)
        meta = GalahadMetadata()
        meta.saves.extend(SaveJob(f"w{j}", (entry,)) for j, entry in enumerate(entries))
        worker.save(meta)
        svc._saves.shutdown(wait=True)
        for entry in entries:
            svc.commit(ChainKey(entry.key))
        nbytes = tokens * LAYERS * 2 * HEADS * HEAD * 2
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        view = memoryview(out.numpy()).cast("B")

        def alone() -> None:
            for entry in entries:
                if svc.load_part(ChainKey(entry.key), 0, out=view) is None:
                    raise SystemExit(f"worker_load: {kind}: load_part refused the entry")

        def step() -> None:
            meta = GalahadMetadata()
            meta.loads.extend(LoadJob(f"r{j}", (entry,), False, tokens) for j, entry in enumerate(entries))
            worker.start_load(meta)
            if device == "cuda":
                torch.cuda.synchronize()
            report = worker.take_report()
            if report is None or report.loaded != {f"r{j}": [(0, None)] for j in range(jobs)}:
                raise SystemExit(f"worker_load: {kind}: the load failed")

        h2d = _H2DLoop(nbytes) if dma and device == "cuda" else None

        def alone_h2d() -> None:
            assert h2d is not None
            with h2d:
                alone()

        cases = [("alone", alone, True), ("stream", step, True), ("whole", step, False)]
        if h2d is not None:
            cases.insert(1, ("alone+h2d", alone_h2d, True))
        for name, fn, streamed in cases:
            w._STREAM_ONE = streamed
            fn()  # warm-up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row[f"{kind}_{name}_gbs"] = round(jobs * nbytes / statistics.median(times) / 1e9, 1)
            row[f"{kind}_{name}_ms"] = round(statistics.median(times) * 1e3, 1)
        w._STREAM_ONE = True
        if h2d is not None:
            row[f"{kind}_h2d_beside_gbs"] = round(h2d.rate(), 1)  # the copies' own rate, beside the reads
            row[f"{kind}_h2d_alone_gbs"] = round(h2d.alone(), 1)
        if phases and kind == "plain":  # where a streamed step's time goes (twenty-sixth session)
            with _Phases() as timing:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    step()
                    timing.add("step (to the copies' end)", time.perf_counter() - t0)
            emit(f"phases_{tokens}", **{k: round(v / reps * 1e3, 2) for k, v in timing.totals.items()},
                 **{f"calls {k}": n // reps for k, n in timing.calls.items()})
            for k, v in sorted(timing.totals.items(), key=lambda kv: -kv[1]):
                print(f"  {k:<44} {v / reps * 1e3:8.2f} ms a step, {timing.calls[k] // reps} calls", flush=True)
        svc.close()
    emit(f"layer_{tokens}", tokens=tokens, jobs=jobs, frame_kib=frame_kib or 4096, **row)
    names = [n for n, *_ in cases]
    print(f"| {tokens} tokens x {jobs} | " + " | ".join(names) + " |\n| --- |" + " ---: |" * len(names))
    for kind in ("plain", "sealed"):
        print(f"| {kind}, GB/s (ms) | " + " | ".join(f"{row[f'{kind}_{n}_gbs']} ({row[f'{kind}_{n}_ms']})"
                                                     for n in names) + " |")
    print(f"worker-load-layer: tokens={tokens} jobs={jobs} " + " ".join(f"{k}={v}" for k, v in row.items()),
          flush=True)


def main() -> int:
    """`_main`, then the temp folder removed (a run writes about 2 GB there); `--dir` is kept."""
    ap = _parser()
    args = ap.parse_args()
    if args.dir:
        return _main(args, Path(args.dir))
    work = Path(tempfile.mkdtemp(prefix="galahad-wl-"))
    try:
        return _main(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--entries", type=int, default=52)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--variants", default="readers,readonly,readonly+stream,slice4096,busy,threads")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layer-tokens", default="", help="e.g. 2048,32768: the layer-order single-entry "
                    "loads instead (`layer_mode`)")
    ap.add_argument("--layer-jobs", type=int, default=1, help="with --layer-tokens: this many jobs (prompts) "
                    "of one entry in each step (`layer_mode`)")
    ap.add_argument("--frame-kib", type=int, default=0, help="with --layer-tokens: save the parts with "
                    "frames of this many KiB (a power of two; 4096 by default)")
    ap.add_argument("--dma", action="store_true", help="with --layer-tokens: also `load_part` alone while "
                    "another pinned buffer is copied to the GPU all along (`alone+h2d`)")
    ap.add_argument("--phases", action="store_true", help="with --layer-tokens: wall time per function of "
                    "a streamed plain step (`_Phases`)")
    return ap


def _main(args: argparse.Namespace, work: Path) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script only
    if args.layer_tokens:
        for n in args.layer_tokens.split(","):
            layer_mode(work, int(n), device, phases=args.phases, jobs=args.layer_jobs, dma=args.dma,
                       frame_kib=args.frame_kib)
        return 0
    ns = Namespace(model="wl", model_fingerprint="wl", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=PayloadOrder.CHUNK)
    per_job = args.entries * ENTRY_BLOCKS
    num_blocks = 2 * args.jobs * per_job + 64  # the loaded jobs, and as many again for `busy`
    caches = _caches(num_blocks, device)
    root = work / "store"
    root.mkdir(parents=True, exist_ok=True)

    def job_entries(svc: KVCacheService, j: int) -> list[EntryRef]:
        tokens = [(j * 100_003 + i * 7919) % 150_000 for i in range(args.entries * 64 + 1)]
        keys = svc.keys(tokens, svc.seed())
        spans = svc.chunking.save_spans(args.entries * 64)
        base = j * per_job
        return [EntryRef(keys[svc.chunking.key_index(s.end)].raw, s.start, s.end,
                         (tuple(range(base + s.start // BLOCK, base + s.end // BLOCK)),)) for s in spans]

    svc = _service(root, ns, 0)
    writer = w.GalahadWorker(svc, 0, RankLayout(), _config(num_blocks), BLOCK)
    writer.register(caches)
    jobs = [job_entries(svc, j) for j in range(args.jobs)]
    t0 = time.perf_counter()
    for j, entries in enumerate(jobs):
        meta = GalahadMetadata()
        meta.saves.append(SaveJob(f"w{j}", tuple(entries)))
        writer.save(meta)
    svc._saves.shutdown(wait=True)
    for entries in jobs:
        for e in entries:
            svc.commit(ChainKey(e.key))
    nbytes = sum(len(e) for e in jobs) * LAYERS * ENTRY_BLOCKS * 2 * BLOCK * HEADS * HEAD * 2
    emit("stored", jobs=args.jobs, entries=args.entries, gb=round(nbytes / 1e9, 2),
         save_s=round(time.perf_counter() - t0, 2))
    expect = {name: t.clone() for name, t in caches.items()}
    svc.close()

    clock = _Clock()
    summary: dict[str, float] = {}
    rows: list[tuple[str, float, float, float, float]] = []
    for variant in args.variants.split(","):
        flags = set(variant.split("+"))  # e.g. readonly+stream
        readers = 0 if "threads" in flags else args.readers
        ahead = next((int(f[5:]) for f in flags if f.startswith("ahead")), None)
        batch = next((int(f[5:]) for f in flags if f.startswith("batch")), None)
        readers = ahead if ahead is not None and readers else readers
        svc = _service(root, ns, readers)
        yield_ms = next((int(f[5:]) for f in flags if f.startswith("yield")), 0)
        svc.loads_first.limit_s = yield_ms / 1e3  # GALAHAD_SAVE_YIELD_MS
        worker = w.GalahadWorker(svc, 0, RankLayout(), _config(num_blocks), BLOCK)
        if ahead is not None:
            worker._ahead = ahead
            worker._entry_pool = ThreadPoolExecutor(ahead, thread_name_prefix="galahad-entry")
            worker._batch = 2 * ahead
        if batch is not None:
            worker._batch = batch
        slice_kib = next((int(f[5:]) for f in flags if f.startswith("slice")), None)
        boot = reader_pool._BOOT
        if slice_kib is not None:  # the reader processes read this much of a frame per read
            reader_pool._BOOT = boot.replace("runpy.run_module", (
                "import galahad.codec as c; c.read_in_small_slices = lambda: c._slices.__setitem__("
                f"slice(None), [{slice_kib << 10}]); runpy.run_module"))
        from galahad.adapters.vllm import cuda as cuda_mod

        cuda_mod._GRAPHS = "eager" not in flags  # read when the transfer is made (register)
        worker.register(caches)  # after the sizes above: the pinned buffers follow them
        sync = "async" not in flags
        if variant == "readers" and device == "cuda":
            emit("scatter_alone", **scatter_alone(worker, jobs[0]))
        stop = threading.Event()
        busy = None
        if "busy" in flags:  # the save threads write other entries all along
            others = [job_entries(svc, args.jobs + j) for j in range(args.jobs)]

            def backlog() -> None:
                n = 0
                while not stop.is_set():
                    meta = GalahadMetadata()
                    entries = others[n % len(others)]
                    # fresh keys each time: every save is a real write
                    meta.saves.append(SaveJob(f"b{n}", tuple(EntryRef(os.urandom(32), e.start, e.end, e.blocks)
                                                             for e in entries)))
                    worker.save(meta)
                    n += 1
                    time.sleep(0.2)
            busy = threading.Thread(target=backlog, daemon=True)
            busy.start()
        old_switch = sys.getswitchinterval()
        if "switch" in flags:
            sys.setswitchinterval(0.0005)
        times, waits, copies, calls, on_device = [], [], [], [], []
        for step in range(args.steps + 1):
            for t in caches.values():
                t[: args.jobs * per_job].zero_()
            if device == "cuda":
                torch.cuda.synchronize()
            meta = GalahadMetadata()
            for j, entries in enumerate(jobs):
                meta.loads.append(LoadJob(f"r{step}-{j}", tuple(entries), not sync, args.entries * 64))
            t0 = time.perf_counter()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                load(worker, meta, "readonly" in flags, "stream" in flags)
                end.record()
                end.synchronize()
                device_s = start.elapsed_time(end) / 1e3
            else:
                load(worker, meta, "readonly" in flags, "stream" in flags)
                device_s = 0.0
            took = time.perf_counter() - t0
            report = worker.take_report()
            wait_s, copy_s, n = clock.take()
            ok = report is not None and all(v == [(0, None)] for v in report.loaded.values())
            if step == 0 and "readonly" in flags:
                continue
            if step == 0:  # warm-up; and the bytes are right
                same = all(torch.equal(caches[k][: args.jobs * per_job], expect[k][: args.jobs * per_job])
                           for k in caches)
                emit(f"{variant}_check", loads_ok=ok, bytes_equal=same)
                if not (ok and same):
                    raise SystemExit(f"worker_load: {variant}: the loads did not land right")
                continue
            times.append(took)
            waits.append(wait_s)
            copies.append(copy_s)
            calls.append(n)
            on_device.append(device_s)
        sys.setswitchinterval(old_switch)
        reader_pool._BOOT = boot
        stop.set()
        if busy is not None:
            busy.join()
        done = svc.snapshot_counters()  # the backlog's saves beside the loads (`busy`)
        svc.close()
        med = statistics.median(times)
        summary[variant] = round(nbytes / med / 1e9, 1)
        rows.append((variant, round(med * 1e3, 1), summary[variant], round(statistics.median(waits) * 1e3, 1),
                     round(statistics.median(copies) * 1e3, 1)))
        emit(variant, readers=readers, step_ms=round(med * 1e3, 1), gbs=summary[variant],
             gbs_min=round(nbytes / max(times) / 1e9, 1), wait_ms=round(statistics.median(waits) * 1e3, 1),
             copy_ms=round(statistics.median(copies) * 1e3, 1), copy_calls=statistics.median(calls),
             device_ms=round(statistics.median(on_device) * 1e3, 1), saves=done.saves,
             saves_skipped=done.saves_skipped, save_wait_s=round(done.save_wait_seconds, 2))
    print("| variant | step ms | GB/s | waiting for reads, ms | copies (host), ms |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print("worker-load: " + " ".join(f"{k}_gbs={v}" for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
