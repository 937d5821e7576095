"""The connector's parts without starting vLLM: stats, worker reports, block copies, registration.

Imports vLLM (its classes are the base classes) but starts no engine: fast.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from galahad.adapters.vllm.blocks import UnsupportedLayout, byte_view  # noqa: E402
from galahad.adapters.vllm.metadata import GalahadWorkerMetadata  # noqa: E402
from galahad.adapters.vllm.stats import LINE_ORDER, GalahadStats, to_data  # noqa: E402
from galahad.domain.counter import Counters  # noqa: E402

pytestmark = pytest.mark.vllm


def _stats(**values: int) -> GalahadStats:
    c = Counters()
    for k, v in values.items():
        if k.startswith("refused_"):
            c.refuse(k[8:], v)
        else:
            setattr(c, k, v)
    return GalahadStats(data=to_data(c, {"errors": 0}))


def test_stats_add_up_across_workers_and_the_scheduler_side() -> None:
    total = _stats(lookups=4, hits_disk=1, refused_damaged=1)
    total.aggregate(_stats(hits_disk=2, bytes_loaded=10, refused_damaged=2, refused_io=1))
    line = total.reduce()
    assert line["hits_disk"] == 3 and line["lookups"] == 4 and line["bytes_loaded"] == 10
    assert line["refused_damaged"] == 3 and line["refused_io"] == 1
    assert line["hit_rate"] == 75.0
    assert list(line)[: len(LINE_ORDER)] == list(LINE_ORDER)
    # the product page's example: `hits_disk=3, loads=3, saver_chain_saved=1, chain_hits=3, hit_rate=25.0`
    assert list(line)[:5] == ["hits_disk", "loads", "saver_chain_saved", "chain_hits", "hit_rate"]
    # every count adds up: totals, per-reason counts, seconds and the adapter-only ones
    a, b = Counters(lookups=4, hits_disk=1, load_seconds=0.5), Counters(hits_disk=2, load_seconds=0.25)
    a.refuse("damaged", 1)
    b.refuse("damaged", 2)
    b.refuse("io", 1)
    b.skip("backlog")
    merged = GalahadStats(data=to_data(a, {"committed": 1})).aggregate(GalahadStats(data=to_data(b, {"errors": 2})))
    line = merged.reduce()
    assert (line["lookups"], line["hits_disk"], line["load_seconds"]) == (4, 3, 0.75)
    assert line["saves_skipped"] == 1 and line["saves_skipped_backlog"] == 1
    assert line["refused_damaged"] == 3 and line["refused_io"] == 1
    assert line["committed"] == 1 and line["errors"] == 2 and line["hit_rate"] == 75.0
    assert GalahadStats().aggregate(GalahadStats(data=to_data(b))).reduce() == GalahadStats(data=to_data(b)).reduce()


def test_stats_rebuilt_from_the_plain_dict_vllm_ships_are_equal() -> None:
    from galahad.adapters.vllm.connector import GalahadConnector

    s = _stats(loads=2, chain_hits=1)
    again = GalahadConnector.build_kv_connector_stats(dict(s.to_dict()))
    assert again.reduce() == s.reduce()
    assert GalahadConnector.build_kv_connector_stats().is_empty()
    assert not s.is_empty()
    # zeros are empty; an adapter-only count (an entry committed) or a skip by reason is not
    assert GalahadStats(data=to_data(Counters(), {"committed": 0})).is_empty()
    assert not GalahadStats(data=to_data(Counters(), {"committed": 1})).is_empty()
    skipped = Counters()
    skipped.skip("backlog")
    assert not GalahadStats(data=to_data(skipped)).is_empty()


def test_worker_reports_merge_every_rank() -> None:
    a = GalahadWorkerMetadata(saved={b"k": [(0, True)]}, loaded={"r": [(0, None)]})
    b = GalahadWorkerMetadata(saved={b"k": [(1, False)], b"j": [(1, True)]}, failed_keys={b"j": "damaged"})
    merged = a.aggregate(b)
    assert merged.saved == {b"k": [(0, True), (1, False)], b"j": [(1, True)]}
    assert merged.loaded == {"r": [(0, None)]} and merged.failed_keys == {b"j": "damaged"}
    assert not GalahadWorkerMetadata()


@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (0, 2, 1, 3)])  # [B,H,N,C] stored HND or NHD
def test_whole_blocks_copy_out_and_back_as_bytes_whatever_the_inner_layout(perm: tuple[int, ...]) -> None:
    blocks, heads, tokens, content = 6, 2, 4, 8
    physical = [(blocks, heads, tokens, content)[i] for i in perm]
    base = torch.randn(*physical).to(torch.bfloat16)
    kv = base.permute(*[perm.index(i) for i in range(4)])  # logical [B,H,N,C] view
    view, shape = byte_view(kv, blocks)
    assert shape == (heads, tokens, content) and view.shape == (blocks, heads * tokens * content * 2)
    out = view.index_select(0, torch.tensor([4, 1]))
    before = kv.clone()
    view.index_copy_(0, torch.tensor([0, 5]), out)
    assert torch.equal(kv[0], before[4]) and torch.equal(kv[5], before[1])
    assert torch.equal(kv[2], before[2])


def test_a_block_that_is_not_one_dense_byte_range_is_refused() -> None:
    kv = torch.zeros(3, 4, 6, 2).permute(1, 0, 2, 3)  # heads outermost: a block is scattered
    with pytest.raises(UnsupportedLayout):
        byte_view(kv, 4)


def test_registering_twice_is_harmless() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from galahad.adapters.vllm.registration import register_connector

    register_connector()
    register_connector()
    assert KVConnectorFactory._registry["GalahadConnector"]().__name__ == "GalahadConnector"
