"""Our keys for SGLang's pages.

SGLang names a page by a bare hex string: a SHA-256 chain over the page's tokens and the pages
before it (research/sglang_hicache_api.md §1.3). It covers neither the model, nor the dtype, nor
the layout, nor the rank, and it is handed unchanged to every rank. We map it to a `ChainKey`
of our own:

    ChainKey = SHA-256("galahad-sglang-page-v1" 0x00 || namespace digest || scope || 0x00 || key)

`scope` is empty for the KV pool. A sidecar pool (mamba state, sliding window, indexer) adds its
name and its page geometry, and a pool whose contents differ per TP rank while the KV is shared
(mamba state of an MLA model) adds the TP rank too. So a page from another namespace, pool or
shard is simply a different key: a miss, never someone else's bytes.

The span of such an entry is `Span(0, page_size)`: one page of `page_size` tokens. Its position
in the prompt is not known to the backend (SGLang passes no offset); the chain key already
pins it, since it hashes every token before it.
"""

from __future__ import annotations

import hashlib

from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span

__all__ = ["page_key", "page_span"]

_TAG = b"galahad-sglang-page-v1\x00"


def page_key(namespace_digest: bytes, sglang_key: str, scope: str = "") -> ChainKey:
    """The entry key of SGLang page `sglang_key` in our namespace (and pool `scope`)."""
    h = hashlib.sha256(_TAG)
    h.update(namespace_digest)
    h.update(scope.encode())
    h.update(b"\x00")
    h.update(sglang_key.encode())
    return ChainKey(h.digest())


def page_span(page_size: int) -> Span:
    """The span recorded in the header of a page entry: one page, `[0, page_size)`."""
    return Span(0, page_size)
