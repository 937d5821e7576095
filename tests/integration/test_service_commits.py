"""A step's commits written side by side (`KVCacheService.commit_many`) on the real filesystem
store: every entry whose parts are durable is committed, the results come back in order, and an
entry missing a part is not committed."""

from __future__ import annotations

from pathlib import Path

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.codec import cipher_lookup
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.service import KVCacheService, SegmentSpec

BLOCK = 16


def _service(root: Path) -> KVCacheService:
    ns = Namespace(model="commits", model_fingerprint="commits", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),),
                   payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    root.mkdir(mode=0o700)
    store = FilesystemBlockStore(root, ns, rescan_s=None)
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))


def test_a_steps_entries_are_committed_together_and_each_result_is_its_own(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    keys = svc.keys(list(range(20 * 64 + 1)), svc.seed())
    entries = [keys[svc.chunking.key_index(64 * (i + 1))] for i in range(20)]
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    for i, key in enumerate(entries):
        if i % 7 == 3:
            continue  # never written: cannot be committed
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segment, [bytes([i]) * (2 * BLOCK * 4 * 4)])
    results = svc.commit_many(entries)
    assert results == [i % 7 != 3 for i in range(20)]
    assert [svc.is_committed(k) for k in entries] == results
    assert svc.commit_many(entries) == results  # committing again: the same answers, no error
    svc.close()
