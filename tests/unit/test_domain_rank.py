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


def test_tp_ranks_holding_the_same_kv_head_share_one_part() -> None:
    # 4 TP ranks, 2 KV heads: ranks 0,1 hold head 0 and ranks 2,3 head 1, in both stages
    layout = RankLayout(tp_size=4, pp_size=2, tp_replicas=2)
    assert [layout.part_of(r) for r in layout.all_ranks()] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert layout.parts() == (0, 2, 4, 6)
    assert [r for r in layout.all_ranks() if layout.writes(r)] == [0, 2, 4, 6]
    assert not layout.is_complete([0, 4, 6]) and layout.is_complete([0, 2, 4, 6])


def test_one_kv_head_over_two_tp_ranks_is_stored_once() -> None:
    layout = RankLayout(tp_size=2, tp_replicas=2)
    assert layout.parts() == (0,) and [layout.part_of(r) for r in (0, 1)] == [0, 0]
    assert layout.replicas == 2 and layout.describe() == (
        "tp 2 x pp 1, KV replicated on 2 TP ranks: 1 part per entry")


def test_whole_stage_replication_equals_replicas_of_the_tp_size() -> None:
    assert RankLayout(4, 2, replicated=True).parts() == RankLayout(4, 2, tp_replicas=4).parts()
    assert RankLayout(2, 1).describe() == "tp 2 x pp 1"


@pytest.mark.parametrize("replicas", [0, 3, 8])
def test_replicas_that_do_not_divide_the_tp_size_are_refused(replicas: int) -> None:
    with pytest.raises(ValueError, match="tp_replicas"):
        RankLayout(tp_size=4, tp_replicas=replicas)


def test_data_parallel_engines_count_gpu_ranks_but_not_parts() -> None:
    """Each data-parallel engine runs the same tp x pp layout over the same entries: the commit
    rule is unchanged, and the deployment's GPU ranks (a licence's points) are tp x pp x dp."""
    layout = RankLayout(tp_size=2, pp_size=2, dp_size=3)
    assert layout.world_size == 4 and layout.parts() == (0, 1, 2, 3)
    assert layout.gpu_ranks == 12
    assert layout.describe() == "tp 2 x pp 2 x dp 3"
    assert RankLayout(tp_size=2).gpu_ranks == 2 and RankLayout(tp_size=2).describe() == "tp 2 x pp 1"
    with pytest.raises(ValueError, match="dp_size"):
        RankLayout(dp_size=0)
