"""Entries this server cannot open: a checksum-only part where a key is set (a plain server wrote
it into the same folder), or a part sealed under a key this server does not hold. Neither is
offered by lookups: they used to hit it on every request for a load that then failed
(`refused_key`). The lookup reads a committed entry's header once to tell. An entry sealed under
a key that may come back (a wrong key setting, a key setting lost at a restart, another server's
key) is kept as it is, and a save of its prompt leaves it alone: a wrong key loses nothing. One
sealed under a key retired on purpose (the store's record of retired keys lists it), or plain
where a key is set, is set aside when its prompt is saved again and written anew under the key in
use. Real stores, real files, several services on one folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from galahad.adapters.crypto.key import Keyring
from galahad.domain.chunking import Span
from galahad.domain.namespace import PayloadOrder
from galahad.domain.secret import SecretKey
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import BLOCK, LAYERS, helper_service

SHAPE = (1, 2, BLOCK, 4)


def _record(root: Path) -> list[str]:
    """The lines of the store's record of retired keys, comments left out."""
    return [line for line in (root / "galahad-retired-keys").read_text().splitlines() if not line.startswith("#")]


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


def test_a_layer_order_lookup_passes_an_entry_it_cannot_open_for_a_shorter_one_it_can(tmp_path: Path) -> None:
    """Layer order asks the store about every block end of a prompt in one call (`first_committed`):
    the longest committed entry another key sealed is passed over, and the lookup goes on to the
    longest this server can open, or to an entry it holds in memory (a save still being written)."""
    root = tmp_path / "store"
    tokens = list(range(400))
    other = helper_service(root, Keyring(SecretKey(os.urandom(32))), order=PayloadOrder.LAYER)
    here = helper_service(root, Keyring(SecretKey(os.urandom(32))), order=PayloadOrder.LAYER)
    keys = here.keys(tokens, here.seed())
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
    for svc, end in ((other, 320), (here, 160)):
        assert svc.save_part(keys[end // BLOCK - 1], Span(0, end), 0, segments,
                             [os.urandom(4 * 2 * BLOCK * 4) for _ in range(LAYERS)])
        assert svc.commit(keys[end // BLOCK - 1])
    hit = here.lookup(tokens, here.seed())
    assert hit is not None and hit.end == 160 and hit.entries[0][1] == keys[160 // BLOCK - 1]
    held = here.lookup(tokens, here.seed(), held=lambda key: key == keys[240 // BLOCK - 1])
    assert held is not None and held.end == 240
    assert other.lookup(tokens, other.seed()).end == 320  # the server that sealed it finds it
    assert here.lookup(tokens, here.seed(), already=160) is None  # nothing longer it can open
    for svc in (other, here):
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


def test_a_save_sets_aside_an_entry_sealed_under_a_retired_key_and_writes_it_anew(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/security.md, Rotation: once the old key's line is deleted, a prompt used again is
    recomputed and saved under the new key. It used to stay a miss until the store evicted the
    old entry: `is_committed` said "already saved" to every save. The same for plain entries once
    a key is set."""
    root = tmp_path / "store"
    old, new = SecretKey(os.urandom(32)), SecretKey(os.urandom(32))
    prompts = {name: list(range(start, start + 321)) for name, start in (("sealed", 0), ("plain", 5000))}
    before = helper_service(root, Keyring(old))
    _save_prompt(before, prompts["sealed"])
    plain = helper_service(root)
    _save_prompt(plain, prompts["plain"])
    rotating = helper_service(root, Keyring(new, (old,)))  # step 2: the old key retired, still read
    keys = {name: rotating.keys(p, rotating.seed())[rotating.chunking.key_index(64)] for name, p in prompts.items()}
    assert rotating.holds(keys["sealed"])  # it opens it: nothing to save
    assert not rotating.holds(keys["plain"])  # plain under a key: set aside, saved anew
    assert _record(root) == [f"{old.key_id.hex()} {new.key_id.hex()}"]  # retired by the new key
    caplog.clear()  # `rotating` said it once too, for the plain entry
    with caplog.at_level(logging.WARNING, logger="galahad"):
        after = helper_service(root, Keyring(new))  # step 3: the old key's line deleted
        assert after.lookup(prompts["sealed"], after.seed()) is None  # a miss, said once
        assert not after.holds(keys["sealed"])  # so the engine saves it: the old entry is set aside
    said = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
    assert len(said) == 1 and f"sealed under key id {old.key_id.hex()}" in said[0], said
    assert "set aside and written anew" in said[0] and str(root / "galahad-retired-keys") in said[0]
    quarantine = root / f"ns-{after.namespace.hex}" / "quarantine"
    assert sorted(p.name.rsplit(".", 1)[1] for p in quarantine.iterdir()) == ["key", "key"]
    for name in prompts:
        assert not after.store.is_committed(keys[name])
        _save_prompt(after, prompts[name])  # what the engine then does
        assert after.lookup(prompts[name], after.seed()) is not None and after.load_part(keys[name], 0) is not None
        assert after.holds(keys[name])  # and later saves of it are no-ops again
    assert after.counters.quarantined == 0  # not damage: the counter that alarms stays quiet
    for svc in (before, plain, rotating, after):
        svc.close()


@pytest.mark.parametrize("wrong", ["another key", "no key"])
def test_a_wrong_or_missing_key_loses_nothing_and_the_right_key_finds_every_entry_again(
        tmp_path: Path, wrong: str, caplog: pytest.LogCaptureFixture) -> None:
    """A restart with the wrong key (a mistyped GALAHAD_KEY_FILE makes a new one; a key command
    answering for another environment) or none (the key setting lost at a restart): the entries
    are misses, and saving their prompts again leaves them alone. Back with the right key, every
    one is found again. A key made current again is struck from the record of retired keys."""
    root = tmp_path / "store"
    right = Keyring(SecretKey(os.urandom(32)))
    prompts = [list(range(start, start + 321)) for start in (0, 5000)]
    first = helper_service(root, right)
    for prompt in prompts:
        _save_prompt(first, prompt)
    with caplog.at_level(logging.WARNING, logger="galahad"):
        mistaken = helper_service(root, Keyring(SecretKey(os.urandom(32))) if wrong == "another key" else None)
        for prompt in prompts:
            key = mistaken.keys(prompt, mistaken.seed())[mistaken.chunking.key_index(64)]
            assert mistaken.lookup(prompt, mistaken.seed()) is None
            assert mistaken.holds(key)  # nothing for the engine to save: the entry is kept
    said = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
    assert len(said) == 1 and "kept as they are" in said[0], said
    assert not (root / f"ns-{mistaken.namespace.hex}" / "quarantine").exists()
    again = helper_service(root, right)
    for prompt in prompts:
        assert again.lookup(prompt, again.seed()) is not None
    # the right key retired by a rotation, then made current again: struck from the record
    newer = SecretKey(os.urandom(32))
    retiring = helper_service(root, Keyring(newer, (right.current(),)))
    assert _record(root) == [f"{right.current().key_id.hex()} {newer.key_id.hex()}"]
    back = helper_service(root, right)
    assert _record(root) == []
    assert all(back.lookup(p, back.seed()) is not None for p in prompts)
    for svc in (first, mistaken, again, retiring, back):
        svc.close()


def test_a_key_id_added_to_the_record_by_hand_lets_saves_replace_its_entries(tmp_path: Path) -> None:
    """A key lost for good (never a retired line anywhere): the operator adds its id, as the
    warning prints it, to the record; junk lines are ignored, and the record is never a link."""
    root = tmp_path / "store"
    lost = SecretKey(os.urandom(32))
    tokens = list(range(321))
    _save_prompt(helper_service(root, Keyring(lost)), tokens)
    (root / "galahad-retired-keys").write_text(f"not a key id\n{lost.key_id.hex().upper()}  # lost in March\n")
    now = helper_service(root, Keyring(SecretKey(os.urandom(32))))
    key = now.keys(tokens, now.seed())[now.chunking.key_index(64)]
    assert not now.holds(key)  # set aside: the save writes it anew
    assert not now.store.is_committed(key)
    now.close()
    (root / "galahad-retired-keys").unlink()
    os.symlink("/etc/hostname", root / "galahad-retired-keys")
    _save_prompt(helper_service(root, Keyring(lost)), list(range(5000, 5321)))
    linked = helper_service(root, Keyring(SecretKey(os.urandom(32))))
    key = linked.keys(list(range(5000, 5321)), linked.seed())[linked.chunking.key_index(64)]
    assert linked.holds(key)  # the link is not read: nothing is known retired, the entry is kept
    linked.close()


def test_a_server_without_the_new_key_never_replaces_entries_during_a_two_restart_rotation(tmp_path: Path) -> None:
    """docs/security.md, Rotation, several servers on one folder: the first restart lists the new
    key as a retired line, so the record notes it retired (by the old key) until a server starts
    with it first. A server with a wrong key, or none, started meanwhile holds neither key: it
    must not take the new key for retired and set aside the entries the others seal under it.
    (With a record of bare ids it did, for as long as it ran.)"""
    root = tmp_path / "store"
    old, new = SecretKey(os.urandom(32)), SecretKey(os.urandom(32))
    prompts = [list(range(start, start + 321)) for start in (0, 5000)]
    first = helper_service(root, Keyring(old))
    _save_prompt(first, prompts[0])  # sealed under the old key
    restart1 = helper_service(root, Keyring(old, (new,)))  # the new key added as a retired line
    assert _record(root) == [f"{new.key_id.hex()} {old.key_id.hex()}"]
    strays = [helper_service(root, Keyring(SecretKey(os.urandom(32)))), helper_service(root)]  # started now
    restart2 = helper_service(root, Keyring(new, (old,)))  # the new key first, the old one retired
    assert _record(root) == [f"{old.key_id.hex()} {new.key_id.hex()}"]
    _save_prompt(restart2, prompts[1])  # sealed under the new key
    for stray in strays:
        for prompt in prompts:
            key = stray.keys(prompt, stray.seed())[stray.chunking.key_index(64)]
            assert stray.holds(key)  # kept: this server holds no key that retired either
            assert restart2.store.is_committed(key)
    step3 = helper_service(root, Keyring(new))  # the old key's line deleted
    keys = [step3.keys(p, step3.seed())[step3.chunking.key_index(64)] for p in prompts]
    assert not step3.holds(keys[0])  # retired by the key it holds: set aside, saved anew
    assert step3.holds(keys[1])  # its own
    for svc in (first, restart1, *strays, restart2, step3):
        svc.close()
