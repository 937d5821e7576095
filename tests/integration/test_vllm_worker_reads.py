"""The worker's load path over many entries (chunk order: one entry per 64 tokens): entries read
side by side, copied in as each verifies, and a failure in the middle leaving exactly the verified
prefix. A real service over the filesystem store and real KV tensors, on the CPU (the byte path)
and, marked `gpu`, on CUDA (pinned buffers and the load stream); no engine started (the
engine-level checks are test_vllm_sharing.py and test_vllm_degraded.py)."""

from __future__ import annotations

import os
import time
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, LoadJob, SaveJob  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.format.codec import cipher_lookup  # noqa: E402
from galahad.domain.chain import ChainKey  # noqa: E402
from galahad.domain.chunking import Chunking  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.adapters.helpers.pool import HelperRecipe  # noqa: E402
from galahad.app.service import KVCacheService  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK, NUM_BLOCKS, LAYERS = 16, 96, 3
CHUNKS = 12  # 12 entries of 64 tokens (4 blocks each): more than the worker reads at once
PAGE = (2, BLOCK, 16)  # K and V, tokens, heads x head size (float32)


def _config() -> SimpleNamespace:
    names = [f"layer.{i}" for i in range(LAYERS)]
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[SimpleNamespace(layer_names=names)])


# cuda-helpers: the same loads read by reader processes into a shared pinned region (galahad.adapters.helpers.pool)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-helpers", marks=pytest.mark.gpu)]


def _caches(device: str, fill: float | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for i in range(LAYERS):
        t = torch.randn(NUM_BLOCKS, *PAGE, generator=gen) if fill is None else torch.full((NUM_BLOCKS, *PAGE), fill)
        out[f"layer.{i}"] = t.to(device)
    return out


@pytest.fixture(params=DEVICES)
def stack(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    ns = Namespace(model="reads", model_fingerprint="reads", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),),
                   payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    store = FilesystemBlockStore(root, ns, rescan_s=None)
    svc = KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                         layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))
    if request.param == "cuda-helpers":
        svc.helper_recipe = HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,))
        svc.reader_processes = 2
    tokens = [(i * 7919) % 30000 for i in range(CHUNKS * 64 + 1)]
    keys = svc.keys(tokens, svc.seed())
    spans = svc.chunking.save_spans(CHUNKS * 64)
    entries = [EntryRef(keys[svc.chunking.key_index(s.end)].raw, s.start, s.end,
                        (tuple(range(s.start // BLOCK, s.end // BLOCK)),)) for s in spans]
    source = _caches(request.param.split("-")[0])
    writer = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    writer.register(source)
    meta = GalahadMetadata()
    meta.saves.append(SaveJob("w", tuple(entries)))
    writer.save(meta)
    svc._saves.shutdown(wait=True)  # every write durable before the loads
    assert all(ok for _key, ok in writer.saver.take_acks())
    for e in entries:
        assert svc.commit(type(keys[0])(e.key))
    yield svc, root, entries, source
    store.close()


def _load(svc: KVCacheService, entries: list[EntryRef], device: str, *, async_load: bool,  # type: ignore[no-untyped-def]
          ahead: int = 4):
    dest = _caches(device, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    # entries in flight: one per two usable cores in production (1 here on 2 cores); both paths
    worker.loader.ahead = ahead
    worker.loader.entry_pool = ThreadPoolExecutor(ahead) if ahead > 1 else None
    worker.register(dest)
    # load block b of the source into block b + 48 of the destination
    shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in entries]
    meta = GalahadMetadata()
    meta.loads.append(LoadJob("r", tuple(shifted), async_load, CHUNKS * 64))
    worker.start_load(meta)
    if async_load:
        worker.wait_idle()
        worker.transfer_results()
    if device == "cuda":
        torch.cuda.synchronize()
        assert worker.cuda is not None  # the CUDA path ran, not the byte path
        if svc.reader_processes and len(entries) > 1:  # the helpers read the parts (a job of one
            # entry inside the step is streamed in as it verifies, read in this process)
            assert svc._readers is not None and svc._readers.running and svc._readers.parts_read > 0
    return worker, dest, worker.take_report(), worker.take_invalid_blocks()


@pytest.mark.parametrize("ahead", [1, 4], ids=["one-by-one", "four-at-once"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_every_entry_of_a_long_job_lands_in_its_blocks(stack, async_load: bool, ahead: int) -> None:  # type: ignore[no-untyped-def]
    svc, _store, entries, source = stack
    _worker, dest, report, invalid = _load(svc, entries, next(iter(source.values())).device.type,
                                           async_load=async_load, ahead=ahead)
    assert report is not None and report.loaded["r"] == [(0, None)] and not invalid
    for name in source:
        assert torch.equal(dest[name][48 : 48 + CHUNKS * 4], source[name][: CHUNKS * 4])
        assert not dest[name][: 48].any()  # nothing written elsewhere


@pytest.mark.parametrize("ahead", [1, 4], ids=["one-by-one", "four-at-once"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_damaged_entry_in_the_middle_keeps_exactly_the_verified_prefix(stack, async_load: bool, ahead: int) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    bad = 5
    path = next(p for p in Path(root).rglob(f"{entries[bad].key.hex()}.p0.blk"))
    with open(path, "r+b") as f:  # one payload byte flipped
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _worker, dest, report, invalid = _load(svc, entries, next(iter(source.values())).device.type,
                                           async_load=async_load, ahead=ahead)
    assert report is not None and report.loaded["r"] == [(0, entries[bad].key)]
    assert report.failed_keys == {entries[bad].key: "refused"}  # the worker's reason: not loadable
    assert invalid == set(range(48 + bad * 4, 48 + CHUNKS * 4))  # vLLM recomputes from there on
    for name in source:
        assert torch.equal(dest[name][48 : 48 + bad * 4], source[name][: bad * 4])
    assert svc.snapshot_counters().refused.get("damaged") == 1


def test_an_injected_fault_fails_one_load_job_once_not_every_entry(stack) -> None:  # type: ignore[no-untyped-def]
    svc, _root, entries, source = stack
    svc._fault_load_rate = 1.0  # GALAHAD_FAULT_LOAD_RATE=1: every load job fails, each once
    svc.take_counters()
    _worker, dest, report, invalid = _load(svc, entries, next(iter(source.values())).device.type, async_load=False)
    failed = report.loaded["r"][0][1]
    at = next(i for i, e in enumerate(entries) if e.key == failed)
    assert invalid == set(range(48 + at * 4, 48 + CHUNKS * 4))
    counters = svc.take_counters()
    assert counters.refused == {"injected": 1} and counters.quarantined == 0  # the entry is kept
    for name in source:
        assert torch.equal(dest[name][48 : 48 + at * 4], source[name][: at * 4])


def test_a_job_of_one_entry_lands_in_its_blocks(stack) -> None:  # type: ignore[no-untyped-def]
    """One entry read inside the step: on CUDA copied in layer by layer as its frames verify."""
    svc, _store, entries, source = stack
    _worker, dest, report, invalid = _load(svc, entries[3:4], next(iter(source.values())).device.type,
                                           async_load=False)
    assert report is not None and report.loaded["r"] == [(0, None)] and not invalid
    for name in source:
        assert torch.equal(dest[name][48 + 12 : 48 + 16], source[name][12:16])
        assert not dest[name][: 48 + 12].any() and not dest[name][48 + 16 :].any()


def test_a_damaged_job_of_one_entry_is_invalid_whole(stack) -> None:  # type: ignore[no-untyped-def]
    svc, root, entries, source = stack
    path = next(p for p in Path(root).rglob(f"{entries[3].key.hex()}.p0.blk"))
    with open(path, "r+b") as f:  # a byte of the last frame flipped: earlier layers verify first
        f.seek(-(16 * 4 + 100), os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _worker, _dest, report, invalid = _load(svc, entries[3:4], next(iter(source.values())).device.type,
                                            async_load=False)
    assert report is not None and report.loaded["r"] == [(0, entries[3].key)]
    assert invalid == set(range(48 + 12, 48 + 16))  # vLLM recomputes every block of the entry


def _load_step(svc: KVCacheService, jobs: list[list[EntryRef]], device: str, ahead: int = 4):  # type: ignore[no-untyped-def]
    """Several sync jobs in one step (a batch of requests, chunk order)."""
    dest = _caches(device, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    worker.loader.ahead = ahead
    worker.loader.entry_pool = ThreadPoolExecutor(ahead) if ahead > 1 else None
    worker.register(dest)
    read: list[bytes] = []
    one = worker.loader.read_one

    def counted(entry: EntryRef, **kwargs: Any) -> Any:
        read.append(entry.key)
        return one(entry, **kwargs)

    worker.loader.read_one = counted  # type: ignore[method-assign]  # counts the entries read, reads them
    meta = GalahadMetadata()
    for j, entries in enumerate(jobs):
        shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in entries]
        meta.loads.append(LoadJob(f"r{j}", tuple(shifted), False, len(entries) * 64))
    worker.start_load(meta)
    if device == "cuda":
        torch.cuda.synchronize()
    return dest, worker.take_report(), worker.take_invalid_blocks(), read


@pytest.mark.parametrize("ahead", [1, 4], ids=["one-by-one", "four-at-once"])
def test_jobs_of_one_step_each_keep_their_own_outcome(stack, ahead: int) -> None:  # type: ignore[no-untyped-def]
    """Three requests' jobs in one step; the second one's second entry is damaged: the first and
    third land whole, the second keeps exactly its verified prefix."""
    svc, root, entries, source = stack
    path = next(p for p in Path(root).rglob(f"{entries[5].key.hex()}.p0.blk"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest, report, invalid, read = _load_step(svc, [entries[0:4], entries[4:8], entries[8:12]],
                                             next(iter(source.values())).device.type, ahead)
    assert report is not None
    assert report.loaded == {"r0": [(0, None)], "r1": [(0, entries[5].key)], "r2": [(0, None)]}
    assert report.failed_keys == {entries[5].key: "refused"}
    assert invalid == set(range(48 + 5 * 4, 48 + 8 * 4))  # the second job's blocks after its prefix
    for name in source:
        assert torch.equal(dest[name][48 : 48 + 5 * 4], source[name][: 5 * 4])
        assert not dest[name][48 + 5 * 4 : 48 + 8 * 4].any()
        assert torch.equal(dest[name][48 + 8 * 4 : 48 + 12 * 4], source[name][8 * 4 : 12 * 4])
    assert set(report.timings) == {"r0", "r2"}  # the load figures count whole loads only
    if ahead == 1:  # read one at a time: the failed job's later entries are not read at all
        assert entries[6].key not in read and entries[7].key not in read
        assert entries[8].key in read


def test_an_injected_fault_fails_each_job_of_a_step_once(stack) -> None:  # type: ignore[no-untyped-def]
    svc, _root, entries, source = stack
    svc._fault_load_rate = 1.0  # GALAHAD_FAULT_LOAD_RATE=1: every load job fails, each once
    svc.take_counters()
    dest, report, invalid, _read = _load_step(svc, [entries[0:6], entries[6:12]],
                                              next(iter(source.values())).device.type)
    assert report is not None and set(report.loaded) == {"r0", "r1"}
    starts = []
    for j, job in enumerate((entries[0:6], entries[6:12])):
        failed = report.loaded[f"r{j}"][0][1]
        at = next(i for i, e in enumerate(job) if e.key == failed)
        starts.append(6 * j + at)
        assert set(range(48 + (6 * j + at) * 4, 48 + (6 * j + 6) * 4)) <= invalid
    assert len(invalid) == sum(6 * (j + 1) * 4 - s * 4 for j, s in enumerate(starts))
    assert svc.take_counters().refused == {"injected": 2}
    for name in source:
        for j, s in enumerate(starts):  # each job's prefix before its fault landed
            assert torch.equal(dest[name][48 + 6 * j * 4 : 48 + s * 4], source[name][6 * j * 4 : s * 4])


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_load_path_that_raises_reports_every_job_failed(stack, async_load: bool) -> None:  # type: ignore[no-untyped-def]
    """A bug or a broken runtime inside the load path (here: the read-ahead raising, as a wrong
    call once did in the benchmark's wrapper) must not let vLLM compute on blocks nobody filled:
    every job of the step is reported failed, all its blocks to recompute."""
    svc, _root, entries, source = stack
    dest = _caches(next(iter(source.values())).device.type, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    worker.register(dest)

    def broken(*_args: object, **_kwargs: object) -> object:
        raise TypeError("a bug in the load path")

    worker.loader.reads = broken  # type: ignore[method-assign,assignment]
    worker.loader.submit = broken  # type: ignore[method-assign,assignment]
    meta = GalahadMetadata()
    for j, job in enumerate((entries[0:6], entries[6:12])):
        shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in job]
        meta.loads.append(LoadJob(f"r{j}", tuple(shifted), async_load, 6 * 64))
    worker.start_load(meta)  # does not raise
    if async_load:
        finished, failed = worker.transfer_results()  # one KV cache group: block-level errors
        assert finished == {"r0", "r1"} and not failed
    report = worker.take_report()
    assert report is not None and report.loaded == {"r0": [(0, entries[0].key)], "r1": [(0, entries[6].key)]}
    assert worker.take_invalid_blocks() == set(range(48, 48 + 12 * 4))


def test_a_finish_that_raises_still_reports_its_request_failed_and_the_others_done(stack) -> None:  # type: ignore[no-untyped-def]
    """Finishing an async load (copying it in, giving its pinned buffers back) raising for one
    request must not drop the others finished in the same call, nor leave that one unreported:
    vLLM would wait for them for ever. The failed one is recomputed whole (`failed_recving`)."""
    svc, _root, entries, source = stack
    dest = _caches(next(iter(source.values())).device.type, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    worker.register(dest)
    real = worker.loader.finish

    def finish(job, outcome, **kwargs):  # type: ignore[no-untyped-def]
        if job.req_id == "r0":
            raise RuntimeError("a pinned buffer could not be given back")
        return real(job, outcome, **kwargs)

    worker.loader.finish = finish  # type: ignore[method-assign]
    meta = GalahadMetadata()
    for j, job in enumerate((entries[0:6], entries[6:12])):
        shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in job]
        meta.loads.append(LoadJob(f"r{j}", tuple(shifted), True, 6 * 64))
    worker.start_load(meta)
    worker.wait_idle()
    assert worker.transfer_results() == ({"r0", "r1"}, {"r0"})
    assert worker.transfer_results() == (set(), set())


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_an_entry_whose_read_raises_is_a_failed_load_counted_refused_error(stack, async_load: bool) -> None:  # type: ignore[no-untyped-def]
    """One entry's read raising (as torch did on the H200 for a stream advanced outside inference
    mode) fails its job from that entry, like a damaged part, and is counted: `load_failures`
    and `refused_error`, so the counters show a load that did not happen."""
    svc, _root, entries, source = stack
    bad = entries[2].key
    real = svc.load_part

    def load_part(key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key.raw == bad:
            raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed")
        return real(key, *args, **kwargs)

    svc.load_part = load_part  # type: ignore[method-assign]
    svc.take_counters()
    dest = _caches(next(iter(source.values())).device.type, fill=0.0)
    worker = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    worker.register(dest)
    shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in entries[0:4]]
    meta = GalahadMetadata()
    meta.loads.append(LoadJob("r", tuple(shifted), async_load, 4 * 64))
    worker.start_load(meta)
    if async_load:
        worker.wait_idle()
        assert worker.transfer_results() == ({"r"}, set())
    report = worker.take_report()
    assert report is not None and report.loaded == {"r": [(0, bad)]}
    assert report.failed_keys == {bad: "error"}
    assert worker.take_invalid_blocks() == set(range(48 + 2 * 4, 48 + 4 * 4))
    counters = svc.take_counters()
    assert counters.refused == {"error": 1} and counters.load_failures == 1, counters


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_every_entry_is_read_while_the_job_counts_as_a_running_load(stack, async_load: bool) -> None:  # type: ignore[no-untyped-def]
    """Saves yield to loads (`galahad.app.priority`): each entry of a load job, sync or async, is read
    while the service counts a load running, and none is left counted afterwards."""
    svc, _root, entries, source = stack
    running: list[int] = []
    real = svc.load_part

    def load_part(key, *args, **kwargs):  # type: ignore[no-untyped-def]
        running.append(svc.loads_first.running)
        return real(key, *args, **kwargs)

    svc.load_part = load_part  # type: ignore[method-assign]
    _worker, _dest, report, invalid = _load(svc, entries[:6], next(iter(source.values())).device.type,
                                            async_load=async_load)
    assert report is not None and report.loaded["r"] == [(0, None)] and not invalid
    assert len(running) == 6 and min(running) >= 1, running
    assert svc.loads_first.running == 0


@pytest.mark.parametrize("limit_s", [5.0, 0.0], ids=["yield", "no-yield"])
def test_a_save_waits_for_a_running_load_at_most_its_limit(stack, limit_s: float) -> None:  # type: ignore[no-untyped-def]
    """A save that starts while a load runs is written only once the load ended (counted in
    `save_wait_seconds`); with no wait allowed it is written meanwhile."""
    svc, _root, entries, source = stack
    svc.loads_first.limit_s = limit_s
    svc._saves = ThreadPoolExecutor(2)  # the fixture drained and shut down the first save threads
    svc.take_counters()
    writer = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    writer.register(source)
    fresh = EntryRef(os.urandom(32), entries[0].start, entries[0].end, entries[0].blocks)
    key = ChainKey(fresh.key)

    def written(within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if svc.has_part(key, 0):
                return True
            time.sleep(0.02)
        return svc.has_part(key, 0)

    meta = GalahadMetadata()
    meta.saves.append(SaveJob("w", (fresh,)))
    with svc.loading():
        writer.save(meta)
        during = written(0.6)
    assert during is (limit_s == 0.0)
    assert written(5.0)
    waited = svc.take_counters().save_wait_seconds
    assert (waited >= 0.5) if limit_s else waited == 0.0


@pytest.mark.parametrize("delay_s", [0.0, 0.4])
def test_a_part_written_late_after_its_step_is_named_in_one_warning(  # type: ignore[no-untyped-def]
        stack, delay_s: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A part acknowledged later than the scheduler side waits before asking the store says so
    once (the log then tells a slow disk from a lost acknowledgement)."""
    from galahad.adapters.vllm.worker import saves

    monkeypatch.setattr(saves, "SLOW_SAVE_S", 0.2)
    svc, _root, entries, source = stack
    svc._saves = ThreadPoolExecutor(2)  # the fixture drained and shut down the first save threads
    writer = GalahadWorker(svc, 0, RankLayout(), _config(), BLOCK)
    writer.register(source)
    writer.saver.delay = (delay_s, None)  # what GALAHAD_TEST_SAVE_DELAY sets
    for _ in range(2):
        fresh = EntryRef(os.urandom(32), entries[0].start, entries[0].end, entries[0].blocks)
        meta = GalahadMetadata()
        meta.saves.append(SaveJob("w", (fresh,)))
        writer.save(meta)
    svc._saves.shutdown(wait=True)
    assert len(writer.take_report().saved) == 2  # type: ignore[union-attr]
    warned = caplog.text.count("it was acknowledged late")
    assert warned == (1 if delay_s else 0)


def test_a_job_reads_one_entry_per_reader_process_where_they_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job reads one entry per two usable cores (up to 8) at once, or one per reader process
    where there are more of them (up to 16; they start on a GPU only). CUDA is faked as absent,
    then present (the helpers themselves run in the `gpu` tests), so this runs anywhere."""
    from galahad.adapters.vllm.worker import loads as w

    def service(helpers: int) -> KVCacheService:
        return SimpleNamespace(reader_processes=helpers)  # type: ignore[return-value]

    monkeypatch.setattr(w, "usable_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [w.ahead_for(service(n)) for n in (0, 12, 64)] == [8, 8, 8]  # no CUDA: no helpers
    assert w.ahead_for(None) == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [w.ahead_for(service(n)) for n in (0, 3, 12, 64)] == [8, 8, 12, 16]
    monkeypatch.setattr(w, "usable_cores", lambda: 4)
    assert [w.ahead_for(service(n)) for n in (0, 3, 12)] == [2, 3, 12]
