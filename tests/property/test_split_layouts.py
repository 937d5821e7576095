"""Models split over ranks, without an engine: one `KVCacheService` per rank over a shared store.

The vLLM CPU build cannot run pipeline parallel here (docs/vllm.md, "Split models"), so the
tensor x pipeline logic is checked with the reference in-memory store: part numbers, headers,
the commit rule (all ranks or nothing), replicated parts stored once, a damaged or missing part
of one rank making the entry a miss for every rank, and lookups across layouts (namespace misses).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from galahad.adapters.memory import InMemoryBlockStore
from galahad.format.codec import cipher_lookup
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.app.service import KVCacheService, OtherLayout, SegmentSpec

BLOCK = 16
PROMPT = list(range(3, 3 + 300))  # 300 tokens: one entry of 288 tokens (18 blocks) in layer order


@st.composite
def layouts(draw: Any) -> RankLayout:
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pp = draw(st.integers(1, 4))
    replicas = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    return RankLayout(tp_size=tp, pp_size=pp, tp_replicas=replicas)


@given(layouts(), st.sets(st.integers(0, 31)))
def test_each_rank_reads_the_part_of_the_first_rank_of_its_kv_head_and_commits_need_them_all(
        layout: RankLayout, durable: set[int]) -> None:
    tp, replicas = layout.tp_size, layout.replicas
    for rank in layout.all_ranks():
        part = layout.part_of(rank)
        assert layout.writes(part) and layout.part_of(part) == part
        assert part // tp == rank // tp  # the same pipeline stage
        assert (part % tp) // replicas == (rank % tp) // replicas  # the same KV head group
    assert len(layout.parts()) == layout.world_size // replicas
    assert layout.is_complete(durable) == set(layout.parts()).issubset(durable)


def _namespace(tp: int, pp: int) -> Namespace:
    return Namespace(model="m", model_fingerprint="f" * 64, dtype="float32", kv_cache_dtype="float32",
                     block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 2),), tp_size=tp, pp_size=pp)


def _services(layout: RankLayout, store: InMemoryBlockStore, *,
              others: tuple[OtherLayout, ...] = ()) -> list[KVCacheService]:
    """One service per rank (each rank is its own process in vLLM), all over `store`."""
    check = Xxh3FrameCheck()
    return [KVCacheService(namespace=_namespace(layout.tp_size, layout.pp_size), store=store,
                           chunking=Chunking(PayloadOrder.LAYER, BLOCK, 256), layout=layout,
                           cipher=check, ciphers=cipher_lookup(check), io_threads=1, frame_threads=1,
                           other_layouts=others)
            for _ in layout.all_ranks()]


def _payload(part: int) -> bytes:
    return bytes([part + 1]) * (18 * 64)  # one layer segment: 18 rows of 64 bytes


def _save_all(layout: RankLayout, services: list[KVCacheService]) -> ChainKey:
    """Every writing rank saves its part (the scheduler commits once all parts are durable)."""
    svc = services[0]
    seed = svc.seed()
    hit_end = svc.chunking.probe_ends(len(PROMPT))[0]
    key = svc.keys(PROMPT, seed)[svc.chunking.key_index(hit_end)]
    seg = [SegmentSpec(0, 0, 0, "uint8", (18, 64))]
    writers = [r for r in layout.all_ranks() if layout.writes(r)]
    for rank in writers:
        assert not svc.commit(key)  # never before every part is durable
        assert services[rank].save_part(key, Span(0, hit_end), rank, seg, [_payload(rank)])
    for rank in layout.all_ranks():  # readers of a replicated part have nothing to write
        if not layout.writes(rank):
            assert not services[rank].save_part(key, Span(0, hit_end), rank, seg, [_payload(rank)])
            assert services[rank].has_part(key, rank)
    assert svc.commit(key)
    return key


@given(layouts())
def test_every_rank_loads_its_own_part_named_by_rank_and_world_once_all_parts_are_committed(
        layout: RankLayout) -> None:
    store = InMemoryBlockStore()
    services = _services(layout, store)
    key = _save_all(layout, services)
    assert {k for k, _parts in store._parts.items()} == {key}
    assert sorted(store._parts[key]) == list(layout.parts())  # replicated bytes stored once
    for rank, svc in enumerate(services):
        assert svc.lookup(PROMPT, svc.seed()) is not None
        part = svc.load_part(key, rank)
        assert part is not None
        assert part.header.rank == layout.part_of(rank) and part.header.world == layout.world_size
        assert bytes(part.payload) == _payload(layout.part_of(rank))


@given(layouts(), st.data(), st.sampled_from(["damage", "delete"]))
def test_one_bad_part_makes_the_entry_a_miss_for_every_rank_and_it_is_never_offered_again(
        layout: RankLayout, data: st.DataObject, how: str) -> None:
    store = InMemoryBlockStore()
    services = _services(layout, store)
    key = _save_all(layout, services)
    bad = data.draw(st.sampled_from(layout.parts()))
    if how == "delete":
        del store._parts[key][bad]
        # a missing part: not committed, so no rank is offered the entry (no rank loads)
        assert all(svc.lookup(PROMPT, svc.seed()) is None for svc in services)
        return
    blob = bytearray(store._parts[key][bad])
    blob[len(blob) // 2] ^= 0xFF
    store._parts[key][bad] = bytes(blob)
    readers = [r for r in layout.all_ranks() if layout.part_of(r) == bad]
    assert services[readers[0]].load_part(key, readers[0]) is None  # refused, quarantined
    assert services[readers[0]].counters.refused == {"damaged": 1}
    assert services[readers[0]].counters.quarantined == 1
    for rank, svc in enumerate(services):  # quarantined for all ranks: no rank offers it again
        assert svc.lookup(PROMPT, svc.seed()) is None
        assert not svc.is_committed(key)
        assert svc.load_part(key, rank) is None
    assert key not in store._parts


def test_a_server_split_differently_never_reads_the_entries_but_counts_its_misses_as_namespace_misses(
) -> None:
    tp2_store, tp1_store = InMemoryBlockStore(), InMemoryBlockStore()  # one namespace folder each
    tp2 = RankLayout(tp_size=2)
    _save_all(tp2, _services(tp2, tp2_store))
    other = OtherLayout(_namespace(2, 1).digest(), 2, 1, tp2_store.is_committed)
    tp1 = _services(RankLayout(), tp1_store, others=(other,))[0]
    seed = tp1.seed()
    assert tp1.lookup(PROMPT, seed) is None  # other keys, another store: nothing to read
    assert tp1.in_other_layout(PROMPT, seed)
    assert not tp1.in_other_layout(PROMPT, seed, already=288)  # nothing longer than the local hit
    assert not tp1.in_other_layout([t + 1 for t in PROMPT], seed)  # a prompt nobody saved
    assert not tp1.in_other_layout(PROMPT, tp1.seed(cache_salt="tenant"))  # another tenant
    assert not _services(RankLayout(), tp1_store)[0].in_other_layout(PROMPT, seed)  # no other layout
    assert tp1.counters.as_dict()["bytes_loaded"] == 0


@pytest.mark.parametrize("tp, heads, want", [(2, 1, 2), (4, 2, 2), (4, 8, 1), (2, 2, 1), (4, 3, 1)])
def test_more_tp_ranks_than_kv_heads_makes_the_heads_replicas_of_each_other(
        tp: int, heads: int, want: int) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from galahad.adapters.vllm.namespace import rank_layout_of

    model = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: heads)
    par = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, decode_context_parallel_size=1)
    layout = rank_layout_of(SimpleNamespace(parallel_config=par, model_config=model), SimpleNamespace())
    assert layout.replicas == want
    mla = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 1)
    assert rank_layout_of(SimpleNamespace(parallel_config=par, model_config=mla), SimpleNamespace()).parts() == (0,)
