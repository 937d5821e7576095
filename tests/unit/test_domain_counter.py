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


def test_hit_rate_is_a_percentage_and_zero_without_lookups() -> None:
    assert Counters().hit_rate == 0.0
    assert Counters(lookups=4, hits_disk=1).hit_rate == 25.0


def test_as_dict_and_from_dict_round_trip() -> None:
    c = Counters(lookups=7, bytes_saved=1 << 30, save_seconds=1.5)
    c.refuse(MissReason.NAMESPACE, 4)
    c.skip(SkipReason.FREED, 2)
    assert Counters.from_dict(c.as_dict()) == c
    assert Counters.from_dict({"unknown_counter": 1}) == Counters()
