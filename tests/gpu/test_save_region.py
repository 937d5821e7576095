"""The shared region save processes write from, pinned for the GPU (`PinnedPool.reserve_shared`
with role "save"): KV copied from GPU memory into one of its buffers is sealed and written by a
helper process (`GALAHAD_SAVE_PROCESSES`) and loads back byte for byte. (The CPU side, the helper
writing from shared memory, is in tests/integration/test_save_processes.py; the whole vLLM path
with save processes: `GALAHAD_GPU_SAVE_PROCESSES=2 pytest tests/gpu/test_vllm_gpu_restart.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("gpu: torch.cuda is not available", allow_module_level=True)

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm.cuda import PinnedPool  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.reader_pool import HelperRecipe, ReaderPool  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

SHAPE = (4, 2, 16, 256)  # float32, 128 KiB a layer
LAYERS = 2


def test_kv_copied_from_the_gpu_into_the_save_region_is_written_by_a_helper_and_loads_back(tmp_path: Path) -> None:
    ns = Namespace(model="save-region", model_fingerprint="save-region", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, LAYERS),), payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    (tmp_path / "store").mkdir(mode=0o700)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.CHUNK, 16), layout=RankLayout(), cipher=check,
                         ciphers=cipher_lookup(check))
    pinned = PinnedPool()
    region = pinned.reserve_shared(1 << 20, 2, role="save")
    assert region is not None
    assert pinned.acquire(1 << 20, pin=False, shared=True) is None  # loads never take the saves' region
    writers = ReaderPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), 1, writes=True)
    svc.attach_writers(writers)
    buf = pinned.acquire(1 << 20, pin=False, shared="save")
    assert buf is not None and buf.role == "save" and buf.tensor.is_pinned()
    nbytes = LAYERS * 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    on_gpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    buf.view(nbytes).copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    view = buf.memoryview(nbytes)
    half = nbytes // LAYERS
    segments = [SegmentSpec(0, i, 0, "float32", SHAPE) for i in range(LAYERS)]
    assert svc.save_part(key, Span(0, 64), 0, segments, [view[:half], view[half:]],
                         region_offset=buf.region_offset)
    assert svc.commit(key) and writers.parts_written == 1
    part = svc.load_part(key, 0)
    assert part is not None
    assert bytes(part.payload) == bytes(on_gpu.cpu().numpy())
    svc.close()
