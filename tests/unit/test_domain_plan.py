"""Hybrid state plans: which blocks of each KV cache group an entry holds (domain/plan.py)."""

from __future__ import annotations

from galahad.domain.namespace import GroupKind, KVGroup
from galahad.domain.plan import GroupPart, StatePlan

FULL = KVGroup(GroupKind.FULL, block_size=16, num_layers=4)
SLIDING = KVGroup(GroupKind.SLIDING, block_size=16, num_layers=3, window_tokens=128)
STATE = KVGroup(GroupKind.STATE, block_size=256, num_layers=3)


def test_full_attention_saves_every_block_of_the_span() -> None:
    assert StatePlan((FULL,)).parts(0, 256) == (GroupPart(0, range(0, 16)),)
    assert StatePlan((FULL,)).parts(64, 128) == (GroupPart(0, range(4, 8)),)


def test_sliding_window_saves_only_the_blocks_the_next_token_attends_to() -> None:
    # a token at 256 attends to 129..256: blocks 8..15 hold tokens 128..255
    assert StatePlan((SLIDING,)).parts(0, 256) == (GroupPart(0, range(8, 16)),)
    # a span shorter than the window keeps all of its blocks
    assert StatePlan((SLIDING,)).parts(192, 256) == (GroupPart(0, range(12, 16)),)


def test_a_state_group_saves_the_one_block_at_the_end() -> None:
    assert StatePlan((STATE,)).parts(0, 768) == (GroupPart(0, range(2, 3)),)


def test_a_hybrid_plan_covers_every_group_in_order() -> None:
    plan = StatePlan((SLIDING, FULL))
    assert plan.is_hybrid and not StatePlan((FULL,)).is_hybrid
    assert plan.parts(0, 256) == (GroupPart(0, range(8, 16)), GroupPart(1, range(0, 16)))
