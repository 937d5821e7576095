"""Direct loads (`adapters/vllm/direct.py`): a plain part read into pinned memory unhashed lands in
its blocks in GPU memory, verified there, byte-exact; a damaged byte is a counted, quarantined miss; a part the
path cannot take is read the usual way. Real files, a real store, a real paged cache on the GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("gpu: torch.cuda is not available", allow_module_level=True)

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm import direct as direct_mod  # noqa: E402
from galahad.adapters.vllm.cuda import CudaBlockTransfer  # noqa: E402
from galahad.adapters.vllm.direct import DirectLoads  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.counter import MissReason  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

LAYERS, BLOCKS, PAGE, ROWS = 6, 64, 64 << 10, 40  # 2.5 MiB a layer, 15 MiB a part: 4 frames, the last short


def _service(tmp_path: Path) -> KVCacheService:
    ns = Namespace(model="direct", model_fingerprint="direct", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, LAYERS),), payload_order=PayloadOrder.LAYER)
    check = Xxh3FrameCheck()
    (tmp_path / "store").mkdir(mode=0o700, exist_ok=True)
    return KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                          chunking=Chunking(PayloadOrder.LAYER, 16), layout=RankLayout(), cipher=check,
                          ciphers=cipher_lookup(check))


def _saved(svc: KVCacheService, rows: int = ROWS) -> tuple[object, list[bytes]]:
    key = svc.keys(list(range(16 * rows + 1)), svc.seed())[-1]
    payload = [os.urandom(rows * PAGE) for _ in range(LAYERS)]
    segs = [SegmentSpec(0, i, 0, "float32", (rows, PAGE // 4)) for i in range(LAYERS)]
    assert svc.save_part(key, Span(0, 16 * rows), 0, segs, payload)
    assert svc.commit(key)
    return key, payload


@pytest.fixture
def transfer() -> CudaBlockTransfer:
    layers = [torch.zeros((BLOCKS, PAGE), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    return CudaBlockTransfer(layers, staging_bytes=6 << 20)  # several staging chunks a part


def _host(rows: int = ROWS) -> torch.Tensor:
    return torch.empty(LAYERS * rows * PAGE, dtype=torch.uint8, pin_memory=True)


@pytest.mark.parametrize("piece", [1 << 20, 64 << 20])
def test_a_plain_part_lands_in_its_blocks_byte_exact_verified_on_the_gpu(
        tmp_path: Path, transfer: CudaBlockTransfer, piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_mod, "_PIECE", piece)
    svc = _service(tmp_path)
    key, payload = _saved(svc)
    loads = DirectLoads.start(transfer)
    assert loads is not None
    ids = list(range(BLOCKS - 1, BLOCKS - 1 - (ROWS - 3), -1))  # shuffled-looking, rows 3.. of the part
    one = loads.stream_in([ids], _host(), ROWS, 3)
    part = svc.load_part(key, 0, device=one)
    assert part is not None and one.used and loads.loads == 1
    one.finish()
    torch.cuda.synchronize()
    for layer, data in zip(transfer.layers, payload):
        want = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(ROWS, PAGE)[3:]
        assert torch.equal(layer[ids].cpu(), want)
    assert svc.counters.bytes_loaded > LAYERS * ROWS * PAGE  # counted as any load from the store
    svc.close()


def test_a_damaged_byte_is_a_quarantined_miss_not_a_load(tmp_path: Path, transfer: CudaBlockTransfer) -> None:
    svc = _service(tmp_path)
    key, _payload = _saved(svc)
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.stat().st_size > 8 << 20]
    assert len(files) == 1
    with open(files[0], "r+b") as f:  # one byte in the third frame
        f.seek(os.path.getsize(files[0]) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    loads = DirectLoads.start(transfer)
    assert loads is not None
    one = loads.stream_in([list(range(ROWS))], _host(), ROWS, 0)
    assert svc.load_part(key, 0, device=one) is None
    assert one.used  # it was moved, hashed on the GPU and refused
    one.abandon()
    assert svc.counters.refused.get(MissReason.DAMAGED, 0) == 1, svc.counters
    assert svc.counters.quarantined == 1
    assert svc.load_part(key, 0) is None  # quarantined: no rank offers it again
    svc.close()


def test_a_part_of_another_shape_is_declined_and_read_on_the_host(tmp_path: Path, transfer: CudaBlockTransfer) -> None:
    svc = _service(tmp_path)
    key, payload = _saved(svc, rows=8)
    loads = DirectLoads.start(transfer)
    assert loads is not None
    one = loads.stream_in([list(range(ROWS))], _host(), ROWS, 0)  # this engine expects 40 rows, the part has 8
    part = svc.load_part(key, 0, device=one)
    assert part is not None and not one.used and loads.declined == 1
    assert bytes(part.payload) == b"".join(payload)
    svc.close()
