"""vLLM 0.26 beside 0.32: the block table the connector rebuilds where 0.26 offers none."""

from __future__ import annotations

from types import SimpleNamespace as NS

from galahad.adapters.vllm.compat import BlockTable, block_state_of, num_heads


def _out(new=(), cached=None, scheduled=(), finished=(), preempted=()):  # noqa: ANN001, ANN202
    return NS(scheduled_new_reqs=list(new),
              scheduled_cached_reqs=cached or NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
              num_scheduled_tokens={r: 1 for r in scheduled}, finished_req_ids=set(finished),
              preempted_req_ids=set(preempted))


def test_new_requests_bring_their_table_and_cached_ones_append() -> None:
    table = BlockTable()
    s = table.update(_out(new=[NS(req_id="a", block_ids=([1, 2],))], scheduled=["a"]))
    assert s.get_block_ids("a") == ([1, 2],)
    cached = NS(req_ids=["a"], resumed_req_ids=set(), new_block_ids=[([7],)])
    s = table.update(_out(cached=cached, scheduled=["a"]))
    assert s.get_block_ids("a") == ([1, 2, 7],)


def test_a_resumed_request_replaces_its_table() -> None:
    table = BlockTable()
    table.update(_out(new=[NS(req_id="a", block_ids=([1, 2],))], scheduled=["a"]))
    cached = NS(req_ids=["a"], resumed_req_ids={"a"}, new_block_ids=[([9, 8],)])
    assert table.update(_out(cached=cached, scheduled=["a"])).get_block_ids("a") == ([9, 8],)


def test_unscheduled_finished_and_preempted_requests_have_no_blocks() -> None:
    table = BlockTable()
    table.update(_out(new=[NS(req_id="a", block_ids=([1],)), NS(req_id="b", block_ids=([2],))],
                      scheduled=["a", "b"]))
    s = table.update(_out(scheduled=["b"]))
    assert s.get_block_ids("a") is None and s.get_block_ids("b") == ([2],)
    table.update(_out(finished=["a"], preempted=["b"]))
    assert len(table) == 0


def test_vllm_0_32_block_state_is_used_as_is() -> None:
    state = object()
    out = NS(kv_connector_block_state=state)
    assert block_state_of(out, BlockTable()) is state


def test_num_heads_reads_either_release() -> None:
    assert num_heads(NS(num_kv_heads=8)) == 8
    assert num_heads(NS(num_kv_heads=8, num_head_slots=16)) == 16


def test_the_connector_module_supplies_what_vllm_0_26_lacks_when_it_is_imported() -> None:
    """vLLM 0.26 has no `KVConnectorTransferResults`: a process that imports the connector the way
    vLLM does (the plugin, `kv_connector_module_path`, a spawned tensor-parallel worker) and
    nothing else first must still load it. Run in a fresh interpreter with the name removed."""
    import subprocess
    import sys

    code = (
        "from vllm.distributed.kv_transfer.kv_connector.v1 import base\n"
        "del base.KVConnectorTransferResults\n"
        "import galahad_vllm.connector as c\n"
        "assert base.KVConnectorTransferResults is not None and c.GalahadConnector\n"
        "print('loaded')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "loaded" in run.stdout, run.stderr[-2000:]


def test_the_block_table_given_on_0_26_is_taken_off_before_vllm_ships_the_output() -> None:
    """With tensor parallel workers in other processes vLLM 0.26 pickles the scheduler output
    after `build_connector_meta`; the table's view holds a closure and does not pickle (this
    crashed the engine at TP=2 on the H200). The connector sees it; the output keeps nothing."""
    import pickle

    from galahad.adapters.vllm.compat import with_block_state

    seen = []

    def build(self, out):  # noqa: ANN001, ANN202
        seen.append(out.kv_connector_block_state.get_block_ids("a"))
        return "meta"

    wrapped = with_block_state(build)
    out = _out(new=[NS(req_id="a", block_ids=([1, 2],))], scheduled=["a"])
    assert wrapped(NS(), out) == "meta"
    assert seen == [([1, 2],)]
    assert not hasattr(out, "kv_connector_block_state")
    pickle.dumps(out)
