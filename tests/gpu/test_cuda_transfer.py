"""CUDA gather/scatter of whole blocks is byte-exact for vLLM's real paged KV layouts.

The KV tensors are built as vLLM's GPU model runner builds them: one raw allocation per layer (or
one for all layers, cross-layer), viewed in the backend's memory order and permuted back to the
logical shape. FlashAttention (vLLM 0.26): logical `(B, H, N, 2*D)` (K and V packed in the last
dim), memory NHD `(B, N, H, 2*D)` or HND; cross-layer NHD `(B, L, N, H, 2*D)`; layer-outer
`(L, B, N, H, 2*D)`. Data is random (never zeros), block ids are shuffled, the destination is
poisoned first, and every block not named must stay untouched.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

from galahad.adapters.cuda.pinned import PinnedPool  # noqa: E402
from galahad.adapters.cuda.transfer import CudaBlockTransfer, Piece  # noqa: E402
from galahad.adapters.vllm.blocks import UnsupportedLayout, byte_view  # noqa: E402

B, N, H, D, L = 96, 16, 4, 64, 5  # blocks, tokens per block, KV heads, head size, layers


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, shape + (torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _layers(layout: str, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-layer logical `(B, H, N, 2D)` tensors in the given memory layout, random contents."""
    dev = torch.device("cuda")
    if layout == "NHD":
        mem = [_random((B, N, H, 2 * D), dtype, gen).to(dev) for _ in range(L)]
        return [m.permute(0, 2, 1, 3) for m in mem]
    if layout == "HND":
        return [_random((B, H, N, 2 * D), dtype, gen).to(dev) for _ in range(L)]
    if layout == "cross-layer-NHD":
        mem = _random((B, L, N, H, 2 * D), dtype, gen).to(dev)
        return [mem[:, i].permute(0, 2, 1, 3) for i in range(L)]
    if layout == "layer-outer-NHD":
        mem = _random((L, B, N, H, 2 * D), dtype, gen).to(dev)
        return [mem[i].permute(0, 2, 1, 3) for i in range(L)]
    raise AssertionError(layout)


def _reserved() -> PinnedPool:
    """A pool with its arena pinned, as the worker reserves it at registration (`acquire` never
    pins: without it every copy would go through ordinary memory)."""
    pool = PinnedPool(1 << 30)
    assert pool.reserve_arena(256 << 20) == 256 << 20
    return pool


LAYOUTS = ["NHD", "HND", "cross-layer-NHD", "layer-outer-NHD"]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_then_scatter_is_byte_exact(layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout}{dtype}".encode()))
    src = _layers(layout, dtype, gen)
    views = [byte_view(t, B)[0] for t in src]
    before = [v.cpu().clone() for v in views]
    transfer = CudaBlockTransfer(views, pool=_reserved())
    ids = torch.randperm(B, generator=gen)[:37].tolist()
    got = transfer.gather([ids])
    got.wait()
    expect = torch.cat([b[ids].reshape(-1) for b in before])
    assert torch.equal(got.host, expect)
    sizes = transfer.segment_bytes(len(ids))
    assert [len(v) for v in got.views(sizes)] == sizes

    dst = _layers(layout, dtype, gen)  # a second cache, fresh random contents (the "poison")
    dviews = [byte_view(t, B)[0] for t in dst]
    untouched = [v.cpu().clone() for v in dviews]
    targets = torch.randperm(B, generator=gen)[:37].tolist()
    transfer2 = CudaBlockTransfer(dviews, pool=transfer.pool)
    transfer2.scatter([targets], got.host, nrows=len(ids))
    torch.cuda.current_stream().synchronize()
    for i, v in enumerate(dviews):
        now = v.cpu()
        assert torch.equal(now[targets], before[i][ids]), f"layer {i}"
        rest = sorted(set(range(B)) - set(targets))
        assert torch.equal(now[rest], untouched[i][rest]), f"layer {i}: other blocks changed"
    transfer.release(got)


def test_partial_scatter_from_a_row_offset() -> None:
    gen = torch.Generator().manual_seed(7)
    src = _layers("NHD", torch.bfloat16, gen)
    views = [byte_view(t, B)[0] for t in src]
    t = CudaBlockTransfer(views)
    ids = list(range(10, 30))
    got = t.gather([ids])
    got.wait()
    dst = _layers("NHD", torch.bfloat16, gen)
    dviews = [byte_view(x, B)[0] for x in dst]
    t2 = CudaBlockTransfer(dviews, pool=t.pool)
    t2.scatter([[50, 51, 52]], got.host, nrows=20, first_row=5)
    torch.cuda.synchronize()
    for v, d in zip(views, dviews):
        assert torch.equal(d[[50, 51, 52]].cpu(), v[[15, 16, 17]].cpu())


def test_gather_sees_writes_queued_on_the_compute_stream() -> None:
    gen = torch.Generator().manual_seed(3)
    src = _layers("NHD", torch.bfloat16, gen)
    views = [byte_view(t, B)[0] for t in src]
    t = CudaBlockTransfer(views)
    for _ in range(3):
        big = torch.randn(4096, 4096, device="cuda")
        _ = big @ big  # keep the compute stream busy
        for v in views:
            v[3].fill_(0x5A)  # queued after the matmul, no synchronize
        got = t.gather([[3, 4]])
        got.wait()
        page = views[0].shape[1]
        assert bool((got.host[:page] == 0x5A).all())
        t.release(got)


def test_small_staging_buffer_splits_layers_and_stays_exact() -> None:
    gen = torch.Generator().manual_seed(11)
    src = _layers("HND", torch.bfloat16, gen)
    views = [byte_view(x, B)[0] for x in src]
    page = views[0].shape[1]
    t = CudaBlockTransfer(views, staging_bytes=2 * 8 * page)  # two layers of 8 rows per chunk
    ids = list(range(40, 48))
    got = t.gather([ids])
    got.wait()
    assert torch.equal(got.host, torch.cat([v[ids].reshape(-1).cpu() for v in views]))
    dst = [byte_view(x, B)[0] for x in _layers("HND", torch.bfloat16, gen)]
    t2 = CudaBlockTransfer(dst, staging_bytes=3 * 8 * page)
    t2.scatter([list(range(8))], got.host, nrows=8)
    torch.cuda.synchronize()
    for v, d in zip(views, dst):
        assert torch.equal(d[:8].cpu(), v[ids].cpu())


def test_pinned_buffers_are_reused_not_pinned_per_request() -> None:
    gen = torch.Generator().manual_seed(5)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    pool = _reserved()
    t = CudaBlockTransfer(views, pool=pool)
    for i in range(20):
        got = t.gather([[i, i + 1, i + 2]])
        got.wait()
        t.release(got)
    assert pool.pinned_allocations == 1


def test_saves_held_at_once_share_the_arena_reserved_at_start_and_keep_their_own_bytes() -> None:
    """A save still being written when the next comes: both gathers are served from the one
    arena reserved at registration (`reserve_arena`), nothing pinned on the way, and each piece
    holds its own blocks; released, the pieces join again into the whole arena."""
    gen = torch.Generator().manual_seed(6)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    before = [v.cpu().clone() for v in views]
    pool = PinnedPool(1 << 30)
    pool.reserve_arena(256 << 20)
    assert pool.pinned_allocations == 1
    t = CudaBlockTransfer(views, pool=pool)
    first_ids, second_ids = [1, 2, 3], [70, 8, 9, 40]
    first = t.gather([first_ids])
    second = t.gather([second_ids])  # the first one's buffer is still held
    first.wait()
    second.wait()
    assert pool.pinned_allocations == 1
    assert first.buffer is not None and second.buffer is not None
    assert first.buffer.arena is second.buffer.arena is not None
    assert torch.equal(first.host, torch.cat([b[first_ids].reshape(-1) for b in before]))
    assert torch.equal(second.host, torch.cat([b[second_ids].reshape(-1) for b in before]))
    t.release(first)
    t.release(second)
    whole = pool.acquire(256 << 20)
    assert whole is not None and whole.capacity == 256 << 20 and pool.pinned_allocations == 1


def test_k_and_v_in_separate_planes_are_refused_not_misread() -> None:
    kv = torch.empty(2, B, N, H, D, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(UnsupportedLayout):
        byte_view(kv, B)


@pytest.mark.parametrize("layout", ["NHD", "cross-layer-NHD"])
def test_gather_many_lays_out_each_entry_like_its_own_gather(layout: str) -> None:
    """A step's saves gathered together: entry after entry, each byte-exact as one gather of it
    lays it out (layer-major), whatever their sizes and block order."""
    gen = torch.Generator().manual_seed(31)
    views = [byte_view(t, B)[0] for t in _layers(layout, torch.bfloat16, gen)]
    before = [v.cpu() for v in views]
    t = CudaBlockTransfer(views, pool=_reserved())
    order = torch.randperm(B, generator=gen).tolist()
    pieces = [[order[0:4]], [order[4:8]], [order[8:11]], [order[11:12]], [order[12:16]]]
    assert t.can_gather_many()
    together = t.gather_many(pieces)
    together.wait()
    expect = [torch.cat([b[piece[0]].reshape(-1) for b in before]) for piece in pieces]
    assert torch.equal(together.host, torch.cat(expect))
    offset = t.payload_bytes(4) * 2 + t.payload_bytes(3)  # the fourth entry's segments
    assert [bytes(v) for v in together.views(t.segment_bytes(1), offset)] == [
        bytes(memoryview(expect[3].numpy())[i * t.pages[0] : (i + 1) * t.pages[0]]) for i in range(L)]
    t.release(together)


def test_gathers_through_cuda_graphs_are_byte_exact_batch_after_batch() -> None:
    """Saves of the same padded size replay one captured graph (the first runs eagerly), other
    sizes get their own, a batch needing a larger staging buffer drops and recaptures them; many
    batches of one size are queued behind a busy compute stream before any is waited for (each
    replay's indices in a host buffer of its own). Every payload is exactly its blocks,
    layer-major, entry after entry."""
    gen = torch.Generator().manual_seed(43)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    before = [v.cpu() for v in views]
    t = CudaBlockTransfer(views, pool=_reserved())
    big = torch.randn(4096, 4096, device="cuda")
    # each batch: its entries' block counts; 12 and 9 rows pad to 16, 20 and 30 to 32, 70 to 128
    shapes = [[12], [4, 4, 4], [9], [12], [5, 4], [20], [4] * 5, [30], [70], [12], [3, 3, 3], [20]] * 2
    queued = []
    for k, counts in enumerate(shapes):
        if k % 6 == 0:
            for _ in range(3):
                _ = big @ big  # the gathers queue behind it
        order = torch.randperm(B, generator=gen).tolist()
        pieces, at = [], 0
        for n in counts:
            pieces.append([order[at : at + n]])
            at += n
        got = t.gather(pieces[0]) if len(pieces) == 1 else t.gather_many(pieces)
        queued.append((pieces, got))
    for k, (pieces, got) in enumerate(queued):
        got.wait()
        expect = torch.cat([torch.cat([b[p[0]].reshape(-1) for b in before]) for p in pieces])
        assert torch.equal(got.host, expect), f"batch {k}"
        t.release(got)
    assert len(t._graphs[id(t._save)]) >= 2, "the saves did not go through captured graphs"


def test_gather_many_sees_writes_queued_on_the_compute_stream() -> None:
    gen = torch.Generator().manual_seed(32)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    t = CudaBlockTransfer(views)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        _ = big @ big
    for v in views:
        v[9].fill_(0x6B)  # queued behind the matmuls, no synchronize
    got = t.gather_many([[[1, 2]], [[9]]])
    got.wait()
    page = views[0].shape[1]
    second = t.payload_bytes(2)
    for i in range(L):
        assert bool((got.host[second + i * page : second + (i + 1) * page] == 0x6B).all())


@pytest.mark.parametrize("staging_rows", [10_000, 9], ids=["one-batch", "split-batches"])
@pytest.mark.parametrize("layout", ["NHD", "cross-layer-NHD"])
def test_scatter_many_places_every_payload_like_one_scatter_each(layout: str, staging_rows: int) -> None:
    """A load job's entries scattered together land exactly where one scatter each puts them,
    also when the staging buffer holds only some of them (the batch is split)."""
    gen = torch.Generator().manual_seed(21)
    src = [byte_view(t, B)[0] for t in _layers(layout, torch.bfloat16, gen)]
    page = src[0].shape[1]
    t = CudaBlockTransfer(src, pool=_reserved())
    order = torch.randperm(B, generator=gen).tolist()
    pieces, expect = [], []
    for n, (nrows, first, k) in enumerate([(4, 0, 4), (4, 0, 4), (4, 2, 2), (3, 0, 3), (4, 1, 2), (4, 0, 4)]):
        ids = order[n * 4 : n * 4 + nrows]
        got = t.gather([ids])
        got.wait()
        targets = order[40 + n * 4 : 40 + n * 4 + k]
        pieces.append(Piece([targets], got.host.clone().pin_memory(), nrows, first))
        expect.append((targets, ids[first : first + k]))
    dst = [byte_view(x, B)[0] for x in _layers(layout, torch.bfloat16, gen)]
    untouched = [v.cpu().clone() for v in dst]
    t2 = CudaBlockTransfer(dst, pool=t.pool, staging_bytes=staging_rows * L * page)
    t2.scatter_many(pieces)
    torch.cuda.current_stream().synchronize()
    written = sorted({b for targets, _ids in expect for b in targets})
    for i, (s, d) in enumerate(zip(src, dst)):
        now = d.cpu()
        for targets, ids in expect:
            assert torch.equal(now[targets], s[ids].cpu()), f"layer {i}"
        rest = sorted(set(range(B)) - set(written))
        assert torch.equal(now[rest], untouched[i][rest]), f"layer {i}: other blocks changed"


def test_scatter_many_waits_for_the_compute_stream_before_writing() -> None:
    """A block the forward pass is still writing (queued work) is overwritten only after it."""
    gen = torch.Generator().manual_seed(4)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    t = CudaBlockTransfer(views)
    page = views[0].shape[1]
    payload = torch.full((L * 2 * page,), 0x33, dtype=torch.uint8).pin_memory()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        _ = big @ big
    for v in views:
        v[7].fill_(0x11)  # queued on the compute stream, behind the matmuls
    t.scatter_many([Piece([[7, 8]], payload, 2)])
    torch.cuda.synchronize()
    for v in views:
        assert bool((v[7] == 0x33).all()) and bool((v[8] == 0x33).all())


@pytest.mark.parametrize("group", [1, 3 * 24 * 2048], ids=["each-layer", "groups-of-layers"])
@pytest.mark.parametrize("step", [1, 3000, 10**9], ids=["byte-by-byte", "uneven", "all-at-once"])
def test_a_streamed_scatter_is_byte_exact_however_the_payload_arrives(step: int, group: int) -> None:
    """Layers copied on as the verified prefix grows land exactly like one scatter."""
    gen = torch.Generator().manual_seed(31)
    src = [byte_view(t, B)[0] for t in _layers("NHD", torch.bfloat16, gen)]
    t = CudaBlockTransfer(src, pool=_reserved())
    ids = torch.randperm(B, generator=gen)[:24].tolist()
    got = t.gather([ids])
    got.wait()
    dst = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    untouched = [v.cpu().clone() for v in dst]
    targets = torch.randperm(B, generator=gen)[:20].tolist()
    t2 = CudaBlockTransfer(dst, pool=t.pool)
    s = t2.stream_in([targets], got.host, nrows=24, first_row=4, step=group)
    total = got.nbytes
    points = range(0, total, step) if step > 1 else range(0, total, max(1, total // 500))
    for n in points:
        s.advance(n)
    s.finish()
    torch.cuda.current_stream().synchronize()
    rest = sorted(set(range(B)) - set(targets))
    for i, (a, d) in enumerate(zip(src, dst)):
        now = d.cpu()
        assert torch.equal(now[targets], a[ids[4:]].cpu()), f"layer {i}"
        assert torch.equal(now[rest], untouched[i][rest]), f"layer {i}: other blocks changed"


def _eight_rows(seed: int) -> tuple[list[torch.Tensor], Any, list[torch.Tensor], list[torch.Tensor], CudaBlockTransfer]:
    """Blocks 0-7 of a random cache gathered; a second random cache (and a copy of it) to stream
    them into, through the returned transfer."""
    gen = torch.Generator().manual_seed(seed)
    src = [byte_view(t, B)[0] for t in _layers("NHD", torch.bfloat16, gen)]
    t = CudaBlockTransfer(src, pool=_reserved())
    got = t.gather([list(range(8))])
    got.wait()
    dst = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    return src, got, dst, [v.cpu().clone() for v in dst], CudaBlockTransfer(dst, pool=t.pool)


def test_an_abandoned_stream_copies_only_whole_verified_layers() -> None:
    src, got, dst, before, t2 = _eight_rows(32)
    layer_bytes = 8 * src[0].shape[1]
    s = t2.stream_in([list(range(50, 58))], got.host, nrows=8, step=1)
    s.advance(2 * layer_bytes + layer_bytes // 2)  # two layers and a half verified, then a failure
    s.abandon()
    torch.cuda.current_stream().synchronize()
    for i, (a, d, b) in enumerate(zip(src, dst, before)):
        now = d.cpu()
        if i < 2:  # whole and verified: copied
            assert torch.equal(now[50:58], a[:8].cpu()), f"layer {i}"
        else:  # the half layer and the rest: never touched
            assert torch.equal(now, b), f"layer {i}"


def test_a_small_stream_waits_for_its_step_before_copying() -> None:
    _src, got, dst, before, t2 = _eight_rows(33)
    s = t2.stream_in([list(range(50, 58))], got.host, nrows=8)
    s.advance(got.nbytes - 1)  # all but the last byte: under the default step, nothing copied yet
    assert s.abandon() is None
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(d.cpu(), b) for d, b in zip(dst, before))


def test_a_stream_advanced_by_another_thread_after_a_load_inside_inference_mode() -> None:
    """vLLM loads inside `torch.inference_mode` (the forward's thread); a later load's stream is
    advanced by the threads that open its frames, outside it. The buffers the first load made
    (staging, pinned) must still take the second one's bytes: with a staging buffer made as an
    inference tensor, every such load failed ("Inplace update to inference tensor outside
    InferenceMode") and was recomputed (H200, sealed 2k loads with cryptography 50)."""
    import threading

    src, got, dst, _before, t2 = _eight_rows(34)
    t2.pool.max_bytes = 4 << 30
    with torch.inference_mode():  # the first load: staging and a pinned buffer made in here
        buf = t2.pool.acquire(got.nbytes)
        assert buf is not None
        host = buf.view(got.nbytes)
        host.copy_(got.host)
        t2.scatter_many([Piece([list(range(40, 48))], host, 8)])
        torch.cuda.current_stream().synchronize()
    t2.pool.release(buf)
    failures: list[BaseException] = []

    def opener(s: Any) -> None:  # one of the frame-opening threads: not in inference mode
        try:
            assert not torch.is_inference_mode_enabled()
            again = t2.pool.acquire(got.nbytes)
            again.view(got.nbytes).copy_(got.host)  # the pinned buffer is written, as reads do
            s.advance(got.nbytes)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    s = t2.stream_in([list(range(50, 58))], got.host, nrows=8, step=1)
    th = threading.Thread(target=opener, args=(s,))
    th.start()
    th.join()
    assert not failures, failures
    s.finish()
    torch.cuda.current_stream().synchronize()
    for i, (a, d) in enumerate(zip(src, dst)):
        now = d.cpu()
        assert torch.equal(now[40:48], a[:8].cpu()), f"layer {i}: the load inside inference mode"
        assert torch.equal(now[50:58], a[:8].cpu()), f"layer {i}: the streamed load"


def test_scatter_many_through_cuda_graphs_is_byte_exact_batch_after_batch() -> None:
    """Batches of the same padded size replay one captured graph (the first runs eagerly); other
    sizes get their own; a batch needing a larger staging buffer drops and recaptures them. Every
    batch lands exactly, the padding (the last row repeated) writes nothing else."""

    gen = torch.Generator().manual_seed(41)
    src = [byte_view(t, B)[0] for t in _layers("NHD", torch.bfloat16, gen)]
    t = CudaBlockTransfer(src, pool=_reserved())
    dst = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    expect = [v.cpu().clone() for v in dst]
    t2 = CudaBlockTransfer(dst, pool=t.pool)
    sources = [s.cpu() for s in src]
    # (pieces of (nrows, first_row, k)): placed rows 19, 19, 7, 19, 40 (a larger staging), 19
    sizes = [[(4, 0, 4), (4, 0, 4), (4, 2, 2), (3, 0, 3), (4, 1, 2), (4, 0, 4)],
             [(4, 0, 4)] * 4 + [(3, 0, 3)],
             [(4, 1, 3), (4, 0, 4)],
             [(8, 0, 8), (8, 1, 7), (4, 0, 4)],
             [(8, 0, 8)] * 5,
             [(6, 2, 4), (8, 0, 8), (7, 0, 7)]]
    used = set()
    for n, shape in enumerate(sizes):
        pieces = []
        if len(used) + sum(k for _n, _f, k in shape) > B:
            used.clear()  # targets repeat across batches, never within one
        for nrows, first, k in shape:
            ids = torch.randperm(B, generator=gen)[:nrows].tolist()
            got = t.gather([ids])
            got.wait()
            free = [b for b in torch.randperm(B, generator=gen).tolist() if b not in used]
            targets = free[:k]
            used.update(targets)
            pieces.append(Piece([targets], got.host.clone().pin_memory(), nrows, first))
            for i in range(L):
                expect[i][targets] = sources[i][ids[first : first + k]]
        t2.scatter_many(pieces)
        torch.cuda.current_stream().synchronize()
        for i, d in enumerate(dst):
            assert torch.equal(d.cpu(), expect[i]), f"batch {n}, layer {i}"
    assert t2._graphs, "no batch went through a captured graph"


def test_saves_queued_behind_a_busy_compute_stream_never_make_the_caller_wait() -> None:
    """The engine's thread only queues a save. Gathers of one size, replayed through their graph,
    queued while the compute stream is busy for seconds (the forward pass they must follow), all
    return before it is done; then each payload is exact."""
    gen = torch.Generator().manual_seed(57)
    views = [byte_view(x, B)[0] for x in _layers("NHD", torch.bfloat16, gen)]
    before = [v.cpu() for v in views]
    t = CudaBlockTransfer(views, pool=_reserved())
    order = torch.randperm(B, generator=gen).tolist()
    pieces = [[order[0:5]], [order[5:10]]]
    for _ in range(2):  # the first runs eagerly, the second captures this size's graph
        warm = t.gather_many(pieces)
        warm.wait()
        t.release(warm)
    torch.cuda._sleep(int(3e9))  # the compute stream is busy for a second or more
    busy = torch.cuda.Event()
    busy.record()
    queued = [t.gather_many(pieces) if k % 2 else t.gather([order[0:10]]) for k in range(12)]
    assert not busy.query(), "queuing a save waited for the compute stream"
    expect = torch.cat([torch.cat([b[p[0]].reshape(-1) for b in before]) for p in pieces])
    whole = torch.cat([b[order[0:10]].reshape(-1) for b in before])
    for k, got in enumerate(queued):
        got.wait()
        assert torch.equal(got.host, expect if k % 2 else whole), f"save {k}"
        t.release(got)
