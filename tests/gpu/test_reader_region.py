"""The shared regions pinned for the GPU: the one reader processes read into
(`PinnedPool.reserve_shared`), whose buffers are page-locked, copy to and from the GPU byte-exact,
and where a part a helper process verified lands in GPU memory unchanged; and the arena
(`PinnedPool.reserve_arena`), from which writer processes seal what the GPU copied into it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("gpu: torch.cuda is not available", allow_module_level=True)

from galahad.adapters.cuda.pinned import PinnedPool  # noqa: E402
from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.format.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.adapters.helpers.pool import HelperRecipe, HelperPool  # noqa: E402
from galahad.app.service import KVCacheService, SegmentSpec  # noqa: E402

ENTRY = 9 << 20  # a 64-token entry of an 8B model is about this size


def test_the_shared_region_is_pinned_and_copies_byte_exact() -> None:
    pool = PinnedPool()
    region = pool.reserve_shared(ENTRY, 3)
    assert region is not None and region.size == 3 * (16 << 20)
    assert pool.acquire(ENTRY) is None  # saves and gathers never take the loads' region
    bufs = [pool.acquire(ENTRY, shared=True) for _ in range(3)]
    assert sorted(b.region_offset for b in bufs) == [0, 16 << 20, 32 << 20]
    assert all(b.tensor.is_pinned() for b in bufs)
    data = torch.randint(0, 256, (ENTRY,), dtype=torch.uint8)
    bufs[1].view(ENTRY).copy_(data)
    on_gpu = bufs[1].view(ENTRY).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), data)
    at = bufs[1].region_offset
    assert bytes(region.view[at : at + 64]) == bytes(data[:64].numpy())  # the same memory


def test_a_part_a_helper_verified_lands_on_the_gpu_unchanged(tmp_path: Path) -> None:
    ns = Namespace(model="region", model_fingerprint="region", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 2),), payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    (tmp_path / "store").mkdir(mode=0o700)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.CHUNK, 16), layout=RankLayout(), cipher=check,
                         ciphers=cipher_lookup(check))
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    payload = [os.urandom(4 * 2 * 16 * 256 * 4) for _ in range(2)]
    assert svc.save_part(key, Span(0, 64), 0, [SegmentSpec(0, i, 0, "float32", (4, 2, 16, 256)) for i in range(2)],
                         payload)
    assert svc.commit(key)
    pinned = PinnedPool()
    region = pinned.reserve_shared(1 << 20, 2)
    assert region is not None
    readers = HelperPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 1)
    svc.attach_readers(readers)
    buf = pinned.acquire(1 << 20, shared=True)
    part = svc.load_part(key, 0, out=buf.memoryview(1 << 20), region_offset=buf.region_offset)
    assert part is not None and readers.parts_read == 1
    on_gpu = buf.view(len(part.payload)).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert bytes(on_gpu.cpu().numpy()) == b"".join(payload)
    svc.close()


def test_a_refused_registration_leaves_no_error_for_the_next_kernel() -> None:
    from galahad.adapters.cuda.pinned import _register

    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)  # already page-locked by torch
    assert _register(host).startswith("CUDA refused")  # it will not register it again
    assert float(torch.ones(8, device="cuda").sum().item()) == 8.0  # the launch check finds no error


def test_a_collected_pool_unregisters_its_region() -> None:
    import gc

    pool = PinnedPool()
    region = pool.reserve_shared(ENTRY, 1)
    assert region is not None
    ptr = pool._regions[0][1].data_ptr()
    del pool
    gc.collect()
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    assert int(err) != 0  # already unregistered by the pool's finalizer
    from galahad.adapters.cuda.pinned import _clear_last_error

    _clear_last_error()
    assert float(torch.ones(8, device="cuda").sum().item()) == 8.0


def test_a_save_the_gpu_copied_into_the_arena_is_sealed_by_a_writer_process(tmp_path: Path) -> None:
    from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID, AesGcmCiphers
    from galahad.adapters.crypto.key import Keyring
    from galahad.domain.secret import SecretKey

    ns = Namespace(model="arena", model_fingerprint="arena", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 2),), payload_order=PayloadOrder.CHUNK)
    keyring = Keyring(SecretKey(os.urandom(32)))
    sealed = AesGcmCiphers(keyring)
    (tmp_path / "store").mkdir(mode=0o700)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.CHUNK, 16), layout=RankLayout(), cipher=sealed.for_sealing(),
                         ciphers=lambda cid, kid: sealed.for_key_id(kid) if cid == AES_GCM_CIPHER_ID else None)
    pinned = PinnedPool()
    assert pinned.reserve_arena(64 << 20) == 64 << 20 and pinned.arena_region is not None
    writers = HelperPool(pinned.arena_region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)), 1,
                         work="write")
    svc.attach_writers(writers)
    pinned.acquire(5 << 20)  # held: the save's piece starts inside the arena, not at its first byte
    buf = pinned.acquire(1 << 20)
    assert buf is not None and buf.tensor.is_pinned() and buf.start > 0
    layer = 4 * 2 * 16 * 256 * 4
    on_gpu = torch.randint(0, 256, (2 * layer,), dtype=torch.uint8, device="cuda")
    buf.view(2 * layer).copy_(on_gpu, non_blocking=True)  # as a save's gather copies it out
    torch.cuda.synchronize()
    views = [buf.memoryview(2 * layer)[i * layer : (i + 1) * layer] for i in range(2)]
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    specs = [SegmentSpec(0, i, 0, "float32", (4, 2, 16, 256)) for i in range(2)]
    assert svc.save_part(key, Span(0, 64), 0, specs, views, shared_at=buf.start)
    assert writers.parts_written == 1 and svc.commit(key)
    buf.view(2 * layer).zero_()
    part = svc.load_part(key, 0)
    assert part is not None and bytes(part.payload) == bytes(on_gpu.cpu().numpy())
    svc.close()
