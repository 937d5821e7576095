"""Counters: merged across ranks, reported as deltas (domain/counter.py)."""

from __future__ import annotations

from galahad.domain.counter import Counters, MissReason, SkipReason


def test_refusals_are_counted_by_reason() -> None:
    c = Counters()
    c.refuse(MissReason.DAMAGED)
    c.refuse(MissReason.DAMAGED, 2)
    c.refuse(MissReason.KEY)
    assert c.refused == {"damaged": 3, "key": 1}
    assert c.as_dict()["refused_damaged"] == 3


def test_skipped_saves_are_counted_by_reason_and_in_all() -> None:
    c = Counters()
    c.skip(SkipReason.BACKLOG)
    c.skip(SkipReason.BACKLOG, 2)
    c.skip(SkipReason.STORE)
    assert c.saves_skipped == 4 and c.skipped == {"backlog": 3, "store": 1}
    assert c.as_dict()["saves_skipped"] == 4 and c.as_dict()["saves_skipped_backlog"] == 3


def test_merge_adds_every_counter_and_every_reason() -> None:
    a = Counters(lookups=2, hits_disk=1, load_seconds=0.5)
    a.refuse(MissReason.FORMAT)
    b = Counters(lookups=3, hits_disk=3, load_seconds=0.25)
    b.refuse(MissReason.FORMAT)
    b.refuse(MissReason.IO)
    a.skip(SkipReason.EXIT)
    b.skip(SkipReason.EXIT)
    b.skip(SkipReason.BACKLOG)
    a.merge(b)
    assert (a.lookups, a.hits_disk, a.load_seconds) == (5, 4, 0.75)
    assert a.refused == {"format": 2, "io": 1}
    assert a.saves_skipped == 3 and a.skipped == {"exit": 2, "backlog": 1}


def test_hit_rate_is_a_percentage_and_zero_without_lookups() -> None:
    assert Counters().hit_rate == 0.0
    assert Counters(lookups=4, hits_disk=1).hit_rate == 25.0


def test_as_dict_and_from_dict_round_trip() -> None:
    c = Counters(lookups=7, bytes_saved=1 << 30, save_seconds=1.5)
    c.refuse(MissReason.NAMESPACE, 4)
    c.skip(SkipReason.FREED, 2)
    assert Counters.from_dict(c.as_dict()) == c
    assert Counters.from_dict({"unknown_counter": 1}) == Counters()


def test_take_returns_the_counts_and_resets() -> None:
    c = Counters(loads=3)
    c.refuse(MissReason.MISSING)
    c.skip(SkipReason.BACKLOG)
    snapshot = c.take()
    assert snapshot.loads == 3 and snapshot.refused == {"missing": 1} and snapshot.skipped == {"backlog": 1}
    assert c.is_empty() and c == Counters()
    c.refuse(MissReason.IO)
    assert snapshot.refused == {"missing": 1}  # the snapshot does not share the reset dict
    assert not c.is_empty()
