"""Rank layouts and the commit rule: all ranks or nothing (domain/rank.py)."""

from __future__ import annotations

import pytest

from galahad.domain.rank import RankLayout


def test_rank_numbers_run_pipeline_major() -> None:
    layout = RankLayout(tp_size=4, pp_size=2)
    assert layout.world_size == 8 and layout.all_ranks() == range(8)
    assert layout.rank_of(tp_rank=1, pp_rank=1) == 5


def test_every_rank_writes_its_own_part_when_not_replicated() -> None:
    layout = RankLayout(tp_size=2, pp_size=2)
    assert [layout.part_of(r) for r in layout.all_ranks()] == [0, 1, 2, 3]
    assert all(layout.writes(r) for r in layout.all_ranks())
    assert layout.parts() == (0, 1, 2, 3)


def test_replicated_stages_write_one_part_each_and_every_rank_reads_it() -> None:
    layout = RankLayout(tp_size=4, pp_size=2, replicated=True)
    assert [layout.part_of(r) for r in layout.all_ranks()] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [layout.writes(r) for r in layout.all_ranks()] == [True, False, False, False, True, False, False, False]
    assert layout.parts() == (0, 4)


def test_an_entry_counts_only_when_every_part_is_durable() -> None:
    layout = RankLayout(tp_size=2, pp_size=2)
    assert not layout.is_complete([0, 1, 2])
    assert not layout.is_complete([])
    assert layout.is_complete([3, 2, 1, 0])
    assert layout.is_complete([0, 1, 2, 3, 7])  # extra parts do not hurt
    assert RankLayout(tp_size=2, replicated=True).is_complete([0])


@pytest.mark.parametrize("tp, pp", [(0, 1), (1, 0), (-1, 2)])
def test_empty_layouts_are_refused(tp: int, pp: int) -> None:
    with pytest.raises(ValueError):
        RankLayout(tp_size=tp, pp_size=pp)


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_world_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match="outside world"):
        RankLayout(tp_size=2, pp_size=2).part_of(rank)
