"""A load whose payload is moved and hashed by the caller (`load_part(device=...)`,
`codec.open_part_placed`: the GPU's direct path) is accepted on the same evidence as a host load:
the tags it computed must equal the file's, a damaged frame is a counted, quarantined miss, and a
part it declines (or a sealed one) is read the usual way. The mover here is the host (xxhash over
the mapped file): the GPU's own mover runs in tests/gpu/test_direct_loads.py."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import xxhash

from galahad.adapters.crypto.aesgcm import AesGcmCipher
from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.codec import cipher_lookup
from galahad.domain.chunking import Chunking, Span
from galahad.domain.counter import MissReason
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader
from galahad.service import KVCacheService, SegmentSpec

LAYERS, ROWS, PAGE = 3, 40, 64 << 10  # 7.5 MiB a part: a frame of 4 MiB and a short one of 3.5


class HostMover:
    """Moves a part's payload out of its mapped file and hashes it the way the GPU path does."""

    def __init__(self, *, decline: bool = False, corrupt_frame: int = -1) -> None:
        self.decline, self.corrupt_frame = decline, corrupt_frame
        self.moved: bytes | None = None
        self.calls = 0

    def __call__(self, fd: int, size: int, h: BlockHeader, offset: int, seeds: Sequence[int]) -> list[bytes] | None:
        self.calls += 1
        if self.decline:
            return None
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            data = bytearray(m[offset : offset + h.payload_len])
        fs = h.frame_size
        if self.corrupt_frame >= 0:  # what a flipped bit in the page cache would do
            data[self.corrupt_frame * fs] ^= 0x40
        self.moved = bytes(data)
        return [xxhash.xxh3_128_digest(data[i * fs : (i + 1) * fs], seed=s) for i, s in enumerate(seeds)]


def _service(tmp_path: Path, *, sealed: bool = False) -> KVCacheService:
    ns = Namespace(model="placed", model_fingerprint="placed", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, LAYERS),), payload_order=PayloadOrder.LAYER)
    check = Xxh3FrameCheck()
    cipher = AesGcmCipher(SecretKey(bytes(range(32)))) if sealed else check
    (tmp_path / "store").mkdir(mode=0o700, exist_ok=True)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.LAYER, 16), layout=RankLayout(), cipher=cipher,
                         ciphers=cipher_lookup(check, cipher))
    return svc


def _saved(svc: KVCacheService) -> tuple[object, bytes]:
    key = svc.keys(list(range(16 * ROWS + 1)), svc.seed())[-1]
    payload = [os.urandom(ROWS * PAGE) for _ in range(LAYERS)]
    segs = [SegmentSpec(0, i, 0, "float32", (ROWS, PAGE // 4)) for i in range(LAYERS)]
    assert svc.save_part(key, Span(0, 16 * ROWS), 0, segs, payload)
    assert svc.commit(key)
    return key, b"".join(payload)


def test_a_placed_load_is_accepted_when_every_tag_it_computed_matches(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    key, payload = _saved(svc)
    mover = HostMover()
    part = svc.load_part(key, 0, device=mover)
    assert part is not None and mover.calls == 1 and mover.moved == payload
    assert len(part.payload) == 0 and part.header.payload_len == len(payload)  # it is where the mover put it
    assert svc.counters.load_failures == 0 and svc.counters.bytes_loaded > len(payload)
    svc.close()


@pytest.mark.parametrize("frame", [0, 1])
def test_a_frame_whose_tag_differs_is_a_quarantined_miss(tmp_path: Path, frame: int) -> None:
    svc = _service(tmp_path)
    key, _payload = _saved(svc)
    mover = HostMover(corrupt_frame=frame)
    assert svc.load_part(key, 0, device=mover) is None
    assert svc.counters.refused.get(MissReason.DAMAGED) == 1 and svc.counters.quarantined == 1
    assert svc.load_part(key, 0, device=HostMover()) is None  # set aside: no rank offers it again
    svc.close()


def test_a_declined_part_is_read_on_the_host_as_without_a_mover(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    key, payload = _saved(svc)
    mover = HostMover(decline=True)
    part = svc.load_part(key, 0, device=mover)
    assert part is not None and mover.calls == 1 and bytes(part.payload) == payload
    svc.close()


def test_a_sealed_part_never_reaches_the_mover(tmp_path: Path) -> None:
    svc = _service(tmp_path, sealed=True)
    key, payload = _saved(svc)
    mover = HostMover()
    part = svc.load_part(key, 0, device=mover)
    assert part is not None and mover.calls == 0 and bytes(part.payload) == payload
    assert svc.sealed
    svc.close()


def test_a_mover_that_returns_too_few_tags_is_refused(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    key, _payload = _saved(svc)

    def short(fd: int, size: int, h: BlockHeader, offset: int, seeds: Sequence[int]) -> list[bytes] | None:
        tags = HostMover()(fd, size, h, offset, seeds)
        return None if tags is None else tags[:-1]

    assert svc.load_part(key, 0, device=short) is None
    assert svc.counters.refused.get(MissReason.DAMAGED) == 1
    svc.close()
