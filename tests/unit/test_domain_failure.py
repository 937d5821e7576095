"""The failure rule: a failed entry is a miss for itself and every later entry of its chain."""

from __future__ import annotations

import pytest

from galahad.domain.failure import FailurePolicy, usable_prefix


@pytest.mark.parametrize(
    "ok, usable",
    [([], 0), ([True, True, True], 3), ([False, True, True], 0), ([True, False, True], 1), ([True, True, False], 2)],
)
def test_the_usable_prefix_stops_at_the_first_failure(ok: list[bool], usable: int) -> None:
    assert usable_prefix(ok) == usable


def test_policies_are_named_as_vllm_names_them() -> None:
    assert FailurePolicy("recompute") is FailurePolicy.RECOMPUTE
    assert FailurePolicy("fail") is FailurePolicy.FAIL
    with pytest.raises(ValueError):
        FailurePolicy("ignore")
