"""A store client in its own process, for the crash and concurrency tests, and its checkable blobs.

    python store_worker.py crash ROOT SEED [MAX_BYTES]    put + commit entries until killed
    python store_worker.py stress ROOT WORKER SECONDS     put, commit, read shared keys; JSON summary
    python store_worker.py churn ROOT SECONDS MAX_BYTES   write fresh keys under a small cap (evicts)
    python store_worker.py read ROOT WORKER SECONDS       read shared keys; JSON summary

Every part checks itself: `sha256(body) || body`, where the body starts with the key, the part
number and the writer, then pseudo-random bytes. Any torn, mixed or misplaced file fails `check`.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
import time

from galahad.adapters.fs import FilesystemBlockStore
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import GroupKind, KVGroup, Namespace

NAMESPACE = Namespace(
    model="store-worker",
    model_fingerprint="1" * 64,
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    block_size=16,
    groups=(KVGroup(GroupKind.FULL, 16, 2),),
)
SHARED_KEYS = [ChainKey(hashlib.sha256(b"shared key %d" % i).digest()) for i in range(48)]
SHARED_PARTS = (0, 1)
_HEAD = struct.Struct("<32sHI")  # key, part, writer
_MiB = 1 << 20


def blob(key: ChainKey, part: int, writer: int, size: int) -> bytes:
    """A part of `size` body bytes (plus 32 of digest) that `check` accepts for (key, part) only."""
    head = _HEAD.pack(key.raw, part, writer)
    pattern = random.Random(head).randbytes(4096)  # repeated: cheap to make, so a writer spends its time writing
    fill = max(0, size - len(head))
    body = head + (pattern * (fill // 4096 + 1))[:fill]
    return hashlib.sha256(body).digest() + body


def check(key: ChainKey, part: int, data: bytes | bytearray | memoryview) -> bool:
    data = bytes(data)
    if len(data) < 32 + _HEAD.size or hashlib.sha256(data[32:]).digest() != data[:32]:
        return False
    raw, got_part, _writer = _HEAD.unpack_from(data, 32)
    return raw == key.raw and got_part == part


def pick_size(rng: random.Random) -> int:
    """Small parts, parts of a MiB or two, and now and then one of 33 MiB (split across I/O threads)."""
    roll = rng.random()
    if roll < 0.04:
        return 33 * _MiB + rng.randrange(4096)
    if roll < 0.4:
        return _MiB + rng.randrange(_MiB)
    return rng.randrange(64, 64 * 1024)


def as_buffers(data: bytes, rng: random.Random) -> bytes | list[memoryview]:
    """The blob as one buffer or as a few pieces (a put of a sequence of buffers)."""
    if rng.random() < 0.5:
        return data
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(3))
    bounds = [0, *cuts, len(data)]
    return [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def crash(root: str, seed: int, max_bytes: int | None) -> None:
    """Put and commit multi-part entries until killed, saying which are committed (and which may
    be quarantined) on stdout, each line written whole (one write: a kill never splits a line, even
    with an unbuffered stdout) and flushed before the next step."""
    rng = random.Random(seed)
    store = FilesystemBlockStore(root, NAMESPACE, max_bytes=max_bytes or 1 << 40, rescan_s=None)
    print("ready", flush=True)
    committed: list[ChainKey] = []
    for i in range(1 << 30):
        key = ChainKey(hashlib.sha256(b"crash %d %d" % (seed, i)).digest())
        parts = tuple(range(rng.choice([1, 2, 4])))
        try:
            for part in parts:
                store.put(key, part, as_buffers(blob(key, part, seed, pick_size(rng)), rng))
        except StoreUnavailable:  # a part larger than the cap: skipped, as the service would
            continue
        if store.commit(key, parts):
            _say(f"committed {key.hex} {len(parts)}")
            committed.append(key)
        if committed and rng.random() < 0.05:
            victim = committed.pop(rng.randrange(len(committed)))
            _say(f"quarantining {victim.hex}")
            store.quarantine(victim, "damaged")


def stress(root: str, worker: int, seconds: float) -> dict[str, object]:
    """Put, commit and read the shared keys until the deadline. A part read that does not check,
    or a committed entry that reads as absent (nothing is evicted or quarantined here), is bad."""
    rng = random.Random(worker)
    report: dict[str, object] = {"puts": 0, "reads": 0, "bad": [], "lost": [], "committed": []}
    bad: list[str] = report["bad"]  # type: ignore[assignment]
    lost: list[str] = report["lost"]  # type: ignore[assignment]
    committed: list[str] = report["committed"]  # type: ignore[assignment]
    with FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=1.0) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            key = rng.choice(SHARED_KEYS)
            roll = rng.random()
            if roll < 0.35:
                part = rng.choice(SHARED_PARTS)
                report["puts"] += store.put(key, part, as_buffers(blob(key, part, worker, pick_size(rng)), rng))  # type: ignore[operator]
                if store.commit(key, SHARED_PARTS):
                    committed.append(key.hex)
                continue
            was_committed = store.is_committed(key)
            picks = [(rng.choice(SHARED_KEYS), rng.choice(SHARED_PARTS)) for _ in range(rng.randrange(1, 5))]
            if roll < 0.8:
                picks = [(key, part) for part in SHARED_PARTS]
            for (k, p), data in zip(picks, _read(store, picks, rng)):
                report["reads"] += 1  # type: ignore[operator]
                if data is not None and not check(k, p, data):
                    bad.append(f"{k.hex}.p{p}")
                if data is None and k == key and was_committed:
                    lost.append(f"{k.hex}.p{p}")
    return report


def _read(store: FilesystemBlockStore, picks: list[tuple[ChainKey, int]], rng: random.Random) -> list[bytes | None]:
    how = rng.choice(["get", "read_into", "get_many", "read_many"])
    if how == "get":
        return [store.get(k, p) for k, p in picks]
    if how == "get_many":
        return store.get_many(picks)
    for _attempt in range(10):  # a part may appear, or be replaced, between part_size and the read
        buffers = [bytearray((store.part_size(k, p) or 0) + 64) for k, p in picks]
        try:
            if how == "read_into":
                counts = [store.read_into(k, p, memoryview(b)) for (k, p), b in zip(picks, buffers)]
            else:
                counts = store.read_many([(k, p, memoryview(b)) for (k, p), b in zip(picks, buffers)])
        except ValueError:
            continue
        return [None if n is None else bytes(b[:n]) for n, b in zip(counts, buffers)]
    raise AssertionError("parts kept changing size under the reader")


def churn(root: str, seconds: float, max_bytes: int) -> dict[str, object]:
    """Under a small cap: rewrite the shared keys, then write fresh keys that evict them."""
    rng = random.Random(7)
    with FilesystemBlockStore(root, NAMESPACE, max_bytes=max_bytes, rescan_s=None) as store:
        deadline = time.monotonic() + seconds
        fresh = 0
        while time.monotonic() < deadline:
            for key in rng.sample(SHARED_KEYS, 8):
                for part in SHARED_PARTS:
                    store.put(key, part, blob(key, part, 99, rng.randrange(64 * 1024, 512 * 1024)))
                store.commit(key, SHARED_PARTS)
            for _ in range(8):
                key = ChainKey(hashlib.sha256(b"fresh %d" % fresh).digest())
                fresh += 1
                store.put(key, 0, blob(key, 0, 99, 512 * 1024))
        return {"evictions": store.stats()["evictions"]}


def read(root: str, worker: int, seconds: float) -> dict[str, object]:
    """Read the shared keys while another process evicts them: whole and right, or absent."""
    rng = random.Random(1000 + worker)
    report: dict[str, object] = {"hits": 0, "misses": 0, "bad": []}
    with FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=None) as store:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            picks = [(rng.choice(SHARED_KEYS), rng.choice(SHARED_PARTS)) for _ in range(4)]
            for (k, p), data in zip(picks, _read(store, picks, rng)):
                report["misses" if data is None else "hits"] += 1  # type: ignore[operator]
                if data is not None and not check(k, p, data):
                    report["bad"].append(f"{k.hex}.p{p}")  # type: ignore[attr-defined]
    return report


def main(argv: list[str]) -> int:
    mode, root, *rest = argv
    try:
        if mode == "crash":
            crash(root, int(rest[0]), int(rest[1]) if len(rest) > 1 else None)
        elif mode == "stress":
            print(json.dumps(stress(root, int(rest[0]), float(rest[1]))), flush=True)
        elif mode == "churn":
            print(json.dumps(churn(root, float(rest[0]), int(rest[1]))), flush=True)
        elif mode == "read":
            print(json.dumps(read(root, int(rest[0]), float(rest[1]))), flush=True)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except StoreUnavailable as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
