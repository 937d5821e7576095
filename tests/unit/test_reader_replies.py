"""A reader process's reply carries a part's header as its fields and a numbered segment table
(`galahad.adapters.helpers.pool._compact`, `_settle`): the header the engine process rebuilds is the one the
helper decoded, a table crosses once, and past `_TABLES` tables a new one crosses whole every
time without either side keeping it. The two functions run here on their own; the helper
processes themselves are in tests/integration/test_helper_pool.py."""

from __future__ import annotations

from galahad.adapters.helpers import pool
from galahad.format.v1 import BlockHeader, DType, Segment, SegmentKind


def _header(rows: int, start: int = 0) -> BlockHeader:
    return BlockHeader(namespace=b"N" * 32, chain_key=bytes([start % 256]) * 32, token_start=start,
                       token_end=start + 64, rank=0, world=1, block_size=16,
                       segments=[Segment(0, SegmentKind.KV, DType.U8, layer, (rows, 4096)) for layer in range(3)])


def _helper() -> pool._Helper:
    return pool._Helper(None, None)  # type: ignore[arg-type]  # no process: its tables only


def _round_trip(header: BlockHeader, sent: dict, helper: pool._Helper) -> tuple:
    fields, ref = pool._compact(header, sent)
    return ref, pool._settle(helper, ("ok", fields, ref, 0.5))


def test_headers_are_rebuilt_whole_and_a_table_crosses_once() -> None:
    sent: dict = {}
    helper = _helper()
    first, (ok, header, seconds) = _round_trip(_header(4), sent, helper)
    assert (ok, seconds) == ("ok", 0.5) and header == _header(4)
    assert isinstance(first, tuple) and first[0] == 0  # the table, whole, numbered 0
    again, (_ok, header, _s) = _round_trip(_header(4, start=64), sent, helper)
    assert again == 0 and header == _header(4, start=64)  # only its number
    assert header.segments is helper.segments[0]


def test_past_the_limit_a_new_table_crosses_whole_every_time_and_is_not_kept(monkeypatch) -> None:
    monkeypatch.setattr(pool, "_TABLES", 2)
    sent: dict = {}
    helper = _helper()
    for rows in (1, 2):
        _round_trip(_header(rows), sent, helper)
    for start in (0, 64):
        ref, (_ok, header, _s) = _round_trip(_header(3, start), sent, helper)
        assert ref[0] == -1 and header == _header(3, start)
    assert len(sent) == 2 and sorted(helper.segments) == [0, 1]
    ref, (_ok, header, _s) = _round_trip(_header(2, 64), sent, helper)  # a numbered one still goes by number
    assert ref == 1 and header == _header(2, 64)


def test_a_reply_that_does_not_fit_is_nonsense_not_a_header() -> None:
    helper = _helper()
    fields, _ref = pool._compact(_header(4), {})
    assert pool._settle(helper, ("ok", fields, 7, 0.5))[0] == "nonsense"  # a number never sent
    assert pool._settle(helper, ("ok", fields[:-1], (0, _header(4).segments), 0.5))[0] == "nonsense"
    assert pool._settle(helper, ("ok", 3))[0] == "ok"  # a write's reply goes through as it came
