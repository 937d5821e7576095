"""Entries this server cannot open: a checksum-only part where a key is set (a plain server wrote
it into the same folder), or a part sealed under a key this server does not hold. Each is kept on
disk (the key may come back: a retired key added, encryption turned off again) but no longer
offered by lookups: they used to hit it on every request for a load that then failed
(`refused_key`). The lookup reads a committed entry's header once to tell. Real stores, real
files, three services on one folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from galahad.adapters.crypto.key import Keyring
from galahad.domain.chunking import Span
from galahad.domain.secret import SecretKey
from galahad.service import KVCacheService, SegmentSpec
from helpers.services import BLOCK, LAYERS, helper_service

SHAPE = (1, 2, BLOCK, 4)


def _save_prompt(svc: KVCacheService, tokens: list[int]) -> None:
    key = svc.keys(tokens, svc.seed())[svc.chunking.key_index(64)]
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
    assert svc.save_part(key, Span(0, 64), 0, segments, [os.urandom(4 * 2 * BLOCK * 4) for _ in range(LAYERS)])
    assert svc.commit(key)


def test_an_entry_this_server_cannot_open_is_never_offered_and_is_kept_for_the_servers_that_can(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tokens = list(range(321))  # past the default GALAHAD_MIN_TOKENS; its first 64-token chunk is stored
    plain = helper_service(root)  # no key: checksum-only parts
    _save_prompt(plain, tokens)
    other_key = helper_service(root, Keyring(SecretKey(os.urandom(32))))
    other_tokens = list(range(1000, 1321))
    _save_prompt(other_key, other_tokens)
    sealed = helper_service(root, Keyring(SecretKey(os.urandom(32))))  # a third key: opens neither
    keys = []
    for prompt in (tokens, other_tokens):
        key = sealed.keys(prompt, sealed.seed())[sealed.chunking.key_index(64)]
        assert sealed.store.is_committed(key)  # committed on disk,
        assert sealed.lookup(prompt, sealed.seed()) is None  # but never offered here
        assert not sealed.offers(key)  # nor to an engine that asks entry by entry (SGLang's exists)
        assert sealed.load_part(key, 0) is None  # (asked anyway, the load refuses it: refused_key)
        keys.append(key)
    assert sealed.counters.as_dict()["refused_key"] == 2 and sealed.counters.quarantined == 0
    assert all(sealed.store.is_committed(k) for k in keys)  # kept: the key may come back
    assert plain.lookup(tokens, plain.seed()) is not None  # the server that can open it still finds it
    assert plain.offers(plain.keys(tokens, plain.seed())[plain.chunking.key_index(64)])
    assert other_key.lookup(other_tokens, other_key.seed()) is not None
    for svc in (plain, other_key, sealed):
        svc.close()


def test_an_entry_it_could_not_open_is_offered_once_this_server_saves_it_anew(tmp_path: Path) -> None:
    """What was read of an entry's header is forgotten when this process commits it: an entry
    another key had written, then evicted and saved again here, is offered again."""
    root = tmp_path / "store"
    tokens = list(range(321))
    other = helper_service(root, Keyring(SecretKey(os.urandom(32))))
    _save_prompt(other, tokens)
    here = helper_service(root, Keyring(SecretKey(os.urandom(32))))
    assert here.lookup(tokens, here.seed()) is None  # another key's: not offered
    key = here.keys(tokens, here.seed())[here.chunking.key_index(64)]
    assert here.store.wait_indexed(30)  # the scan at open has seen the other key's entry: it can evict it
    assert here.store.evict(0) >= 1 and not here.store.is_committed(key)
    _save_prompt(here, tokens)  # saved and committed here, under this server's key
    hit = here.lookup(tokens, here.seed())
    assert hit is not None and here.load_part(key, 0) is not None
    for svc in (other, here):
        svc.close()
