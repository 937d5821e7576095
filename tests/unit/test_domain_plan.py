"""Hybrid state plans: which blocks of each KV cache group an entry holds (domain/plan.py)."""

from __future__ import annotations

from galahad.domain.namespace import GroupKind, KVGroup, Namespace
from galahad.domain.plan import GroupPart, GroupRestore, StatePlan

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


def test_a_load_restores_only_what_the_request_resuming_at_its_end_needs() -> None:
    plan = StatePlan((SLIDING, FULL))
    # one entry [0, 256), no local hit: the sliding window's 8 blocks, every full block
    assert plan.restore(0, 256, 0, 256) == (GroupRestore(0, range(8, 16), 0),
                                            GroupRestore(1, range(0, 16), 0))
    # the engine holds [0, 192) already: only what lies beyond, from the matching stored row
    assert plan.restore(0, 256, 192, 256) == (GroupRestore(0, range(12, 16), 4),
                                              GroupRestore(1, range(12, 16), 12))


def test_chunk_entries_fill_only_the_window_at_the_end_of_the_load() -> None:
    plan = StatePlan((SLIDING,))
    # 64-token entries up to 256: the first two lie wholly outside the final window
    got = [plan.restore(s, s + 64, 0, 256)[0] for s in range(0, 256, 64)]
    assert [r.blocks for r in got] == [range(8, 8), range(8, 8), range(8, 12), range(12, 16)]
    assert [r.first_row for r in got[2:]] == [0, 0]
    state = StatePlan((STATE,))
    assert [state.restore(s, s + 256, 0, 768)[0].blocks for s in (0, 256, 512)] == [
        range(2, 2), range(2, 2), range(2, 3)]


def test_the_plan_says_what_each_group_saves() -> None:
    text = StatePlan((SLIDING, FULL, STATE)).describe()
    assert "group 0 (16-token blocks): sliding window of 128 tokens, 3 layers: the last 8 blocks" in text
    assert "group 1 (16-token blocks): full attention, 4 layers: every block of the prefix" in text
    assert "group 2 (256-token blocks): running state" in text


def test_a_different_group_plan_is_a_different_namespace() -> None:
    def digest(*groups: KVGroup) -> bytes:
        return Namespace("m", "f", "float32", "float32", 16, groups).digest()

    wider = KVGroup(GroupKind.SLIDING, block_size=16, num_layers=3, window_tokens=256)
    assert len({digest(FULL), digest(SLIDING, FULL), digest(wider, FULL), digest(FULL, SLIDING)}) == 4
