"""The load-or-recompute cost model, with the figures measured on the H200 machine."""

from __future__ import annotations

import pytest

from galahad.domain.cost import (
    CostModel,
    PrefillFloor,
    PrefillProfile,
    StoreSpeed,
    cached_share_since_boot,
)
from galahad.domain.counter import Counters

# ../shared/gpu/README.md: Qwen3-8B shape, eager recompute; KV 144 KiB per token
H200_PREFILL = PrefillProfile([(2048, 0.053), (8192, 0.224), (32768, 1.283)])
KV_PER_TOKEN = 144 * 1024
# page cache -> pinned -> GPU pipeline 25.7 GB/s on 8 threads; uncached disk about 1.4 GB/s
H200_STORE = StoreSpeed(warm_bytes_per_s=25.7e9, cold_bytes_per_s=1.4e9, overhead_s=0.004)
MODEL = CostModel(H200_PREFILL, H200_STORE)


def test_prefill_profile_hits_its_points_and_interpolates_between_them() -> None:
    assert H200_PREFILL.seconds(2048) == pytest.approx(0.053)
    assert H200_PREFILL.seconds(8192) == pytest.approx(0.224)
    assert 0.224 < H200_PREFILL.seconds(16384) < 1.283
    assert H200_PREFILL.seconds(1024) == pytest.approx(0.0265)
    assert H200_PREFILL.seconds(0) == 0.0


def test_prefill_profile_extrapolates_with_the_last_slope() -> None:
    slope = (1.283 - 0.224) / (32768 - 8192)
    assert H200_PREFILL.seconds(40960) == pytest.approx(1.283 + slope * 8192)


def test_beyond_its_longest_step_a_profile_never_prices_below_that_steps_rate() -> None:
    """Steps of 1024 and 2048 tokens (38.4 and 49.8 ms, an H100): a 32k-token prompt is sixteen
    steps of 2048 at least, not the two points' slope (0.39 s); it took 1.27 s."""
    steps = PrefillProfile([(1024, 0.0384), (2048, 0.0498)])
    assert steps.seconds(32768) == pytest.approx(16 * 0.0498)
    assert steps.seconds(2048) == pytest.approx(0.0498)
    # a 4.8 GB warm hit (8 GB/s) loads, where the slope alone recomputed it
    warm = CostModel(steps, StoreSpeed(8e9, 1e9))
    assert warm.choose(32768, 32768 * KV_PER_TOKEN, cached_share=1.0).load


def test_one_point_profile_scales_linearly() -> None:
    p = PrefillProfile([(1000, 0.01)])
    assert p.seconds(3000) == pytest.approx(0.03)


@pytest.mark.parametrize("bad", [[], [(0, 1.0)], [(10, -1.0)]])
def test_a_profile_without_positive_points_is_refused(bad: list[tuple[int, float]]) -> None:
    with pytest.raises(ValueError):
        PrefillProfile(bad)


def test_warm_page_cache_loads_at_every_measured_length() -> None:
    for tokens in (2048, 8192, 32768):
        choice = MODEL.choose(tokens, tokens * KV_PER_TOKEN, cached_share=1.0)
        assert choice.load, (tokens, choice)
        assert choice.load_s < choice.recompute_s


def test_uncached_disk_recomputes_a_2k_prompt() -> None:
    choice = MODEL.choose(2048, 2048 * KV_PER_TOKEN, cached_share=0.0)
    assert not choice.load
    assert choice.load_s > 4 * choice.recompute_s


def test_a_fast_drive_loads_even_uncached() -> None:
    nvme = CostModel(H200_PREFILL, StoreSpeed(25.7e9, 12e9, 0.004))
    assert nvme.choose(8192, 8192 * KV_PER_TOKEN, cached_share=0.0).load


def test_the_safety_factor_refuses_a_load_that_only_just_wins() -> None:
    speed = StoreSpeed(1e9, 1e9, 0.0)
    prefill = PrefillProfile([(1000, 1.0)])
    nbytes = int(0.95e9)  # load 0.95 s against recompute 1.0 s
    assert CostModel(prefill, speed, safety=1.0).choose(1000, nbytes, 1.0).load
    assert not CostModel(prefill, speed, safety=1.1).choose(1000, nbytes, 1.0).load


def test_a_bypassed_hit_is_counted_and_a_load_is_not() -> None:
    counters = Counters()
    MODEL.choose(2048, 2048 * KV_PER_TOKEN, cached_share=0.0).record(counters)
    MODEL.choose(2048, 2048 * KV_PER_TOKEN, cached_share=1.0).record(counters)
    assert counters.bypassed == 1
    assert counters.as_dict()["bypassed"] == 1


def test_partly_cached_entries_cost_in_between() -> None:
    nbytes = 8192 * KV_PER_TOKEN
    warm, half, cold = (H200_STORE.seconds(nbytes, s) for s in (1.0, 0.5, 0.0))
    assert warm < half < cold
    assert H200_STORE.seconds(nbytes, 7.0) == warm  # shares are clamped to [0, 1]


@pytest.mark.parametrize("args", [(0.0, 1.0), (1.0, 0.0), (1.0, 1.0, -0.1)])
def test_store_speeds_must_be_positive(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        StoreSpeed(*args)


def test_a_safety_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        CostModel(H200_PREFILL, H200_STORE, safety=0.9)


def test_files_touched_since_boot_are_taken_as_cached() -> None:
    assert cached_share_since_boot(written_or_read_at=200.0, boot_at=100.0) == 1.0
    assert cached_share_since_boot(written_or_read_at=50.0, boot_at=100.0) == 0.0


def test_the_prefill_floor_passes_real_figures_and_refuses_a_broken_clock() -> None:
    qwen3_8b = PrefillFloor(flops_per_token=2.0 * 2 * 36 * 4096 * 4096, layers=36)
    assert qwen3_8b.plausible(2048, 0.0508)  # measured on an H200 (vLLM 0.26, CUDA graphs)
    assert qwen3_8b.plausible(128, 0.004)
    assert not qwen3_8b.plausible(2048, 0.0)
    assert not qwen3_8b.plausible(2048, 0.0001)  # 2048 tokens in 0.1 ms: 49 PFLOP/s
    tiny = PrefillFloor(flops_per_token=2.0 * 2 * 4 * 128 * 128, layers=4)
    assert not tiny.plausible(256, 0.000_002)  # below a microsecond a layer, whatever the size
    assert tiny.plausible(256, 0.001)
