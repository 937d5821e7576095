"""A small `KVCacheService` over the real filesystem store, plain or sealed, for the tests of the
reader processes (tests/integration/test_helper_pool.py) and the other store-level tests:
four float32 layers of 16-token blocks, chunk order."""

from __future__ import annotations

from pathlib import Path

from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID, AesGcmCiphers
from galahad.adapters.crypto.key import Keyring
from galahad.adapters.crypto.retired import RECORD_NAME, note_retired_keys
from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.format.codec import cipher_lookup
from galahad.domain.chunking import Chunking
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.app.service import KVCacheService

BLOCK, LAYERS = 16, 4


def helper_service(root: Path, keyring: Keyring | None = None, model: str = "helpers", tp: int = 1,
                   order: PayloadOrder = PayloadOrder.CHUNK) -> KVCacheService:
    """The service over a store in `root` (made 0700 if absent): AES-256-GCM under `keyring`, or
    checksummed frames without one; `tp` tensor-parallel ranks, each writing its own part. The
    keyring's retired keys are noted in the store's record of retired keys, and the record read,
    as a server's start does (`bootstrap`). `order`: the payload order (chunk unless said)."""
    ns = Namespace(model=model, model_fingerprint=model, dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=order, tp_size=tp)
    root.mkdir(mode=0o700, exist_ok=True)
    store = FilesystemBlockStore(root, ns, rescan_s=None)
    if keyring is None:
        check = Xxh3FrameCheck()
        cipher, ciphers = check, cipher_lookup(check)
    else:
        sealed = AesGcmCiphers(keyring)
        cipher = sealed.for_sealing()
        ciphers = lambda cid, kid: sealed.for_key_id(kid) if cid == AES_GCM_CIPHER_ID else None  # noqa: E731
    retired = note_retired_keys(str(root), keyring.current().key_id if keyring else None,
                                [k.key_id for k in keyring.retired] if keyring else ())
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(order, BLOCK),
                          layout=RankLayout(tp_size=tp), cipher=cipher, ciphers=ciphers, retired_keys=retired,
                          retired_record=str(root / RECORD_NAME), frame_threads=2)
