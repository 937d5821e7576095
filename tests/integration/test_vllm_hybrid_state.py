"""A gated-delta-net hybrid model (Qwen3-Next-style) is saved and restored with its state (offline vLLM runs).

vLLM's hybrid KV manager gives the model three state groups (linear attention, one layer each)
and a full-attention group, all with 256-token blocks. With prefix caching in vLLM's `align` mamba
mode, vLLM checkpoints the state at the last block boundary before a prompt's end; an entry holds
that state block of every state layer together with the attention blocks of the prefix.

vLLM's CPU build runs gated delta net only in bfloat16 (head_dim 64). Runs, two at a time on
separate cores: (plain) no connector; (first) saves; (restart) a new process loading from disk;
(perturbed) the same with the loaded *state* negated: the tokens change, so the state is what
the model resumes from; (state-damaged) one byte flipped inside the state segments of every
stored entry (the attention blocks intact): the whole entry is a miss, vLLM recomputes, answers
identical; (chunk) `GALAHAD_PAYLOAD_ORDER=chunk` falls back to one entry per prompt, counted.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from galahad.format.v1 import SegmentKind, decode_header, frame_table  # noqa: E402
from vllm_support.harness import block_files, kv_config  # noqa: E402
from vllm_support.hybrid_model import QWEN3_NEXT, build_qwen3_next  # noqa: E402
from vllm_support.model import prompt_ids  # noqa: E402
from vllm_support.scenario import Scenario, copy_store, together  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
PROMPTS = [prompt_ids(1100, 71), prompt_ids(2100, 72)]
SAVED_ENDS = [1024, 2048]  # (n - 1) // block * block, for vLLM's block of 128 or 256 tokens (`_block`)
VARIANT = PROMPTS[0][:3] + [(PROMPTS[0][3] + 1) % 2000 + 3] + PROMPTS[0][4:]
OTHER = prompt_ids(700, 73)
LLM = {"dtype": "bfloat16", "block_size": None, "enable_prefix_caching": True,
       "mamba_cache_mode": "align"}


def damage_state(path: Path) -> int:
    """Flip one byte in the middle of every state segment of a stored part; returns how many."""
    data = bytearray(path.read_bytes())
    header = decode_header(bytes(data))
    frames = list(frame_table(header))
    offset, flipped = 0, 0
    for seg in header.segments:
        if seg.kind is SegmentKind.STATE:
            at = offset + seg.nbytes // 2
            frame = next(f for f in frames if f.plain_offset <= at < f.plain_offset + f.plain_len)
            data[frame.data_offset + at - frame.plain_offset] ^= 0xFF
            flipped += 1
        offset += seg.nbytes
    path.write_bytes(bytes(data))
    return flipped


@pytest.fixture(scope="module")
def model() -> str:
    return build_qwen3_next()


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario]:
    root = tmp_path_factory.mktemp("hybrid-state")

    def run(name: str, **kw: Any) -> Scenario:
        return Scenario(root, name, prompts=PROMPTS, max_tokens=MAX_TOKENS, llm=LLM, **kw)

    plain = run("plain", kv=None, core="1", extra=[VARIANT])
    first = run("first", kv=kv_config(), core="0")
    together(model, plain, first)
    key = first.key_file
    restart = run("restart", kv=kv_config(), core="0", key_file=key, extra=[OTHER])
    perturbed = run("perturbed", kv=kv_config(), core="1", key_file=key,
                    GALAHAD_TEST_PERTURB_LOAD="state")
    for r in (restart, perturbed):
        copy_store(first, r)
    together(model, restart, perturbed)
    damaged = run("state-damaged", kv=kv_config(), core="0", key_file=key, extra=[OTHER])
    copy_store(first, damaged)
    damaged.note = sum(damage_state(p) for p in block_files(damaged.store))
    chunk = run("chunk", kv=kv_config(), core="1", GALAHAD_PAYLOAD_ORDER="chunk")
    together(model, damaged, chunk)
    return {r.name: r for r in (plain, first, restart, perturbed, damaged, chunk)}


def _state_groups(log: str) -> set[int]:
    return {int(g) for g in re.findall(r"group (\d+) \(\d+-token blocks\): running state", log)}


def _block(log: str) -> int:
    """The block size vLLM chose (one for every group in align mode): the smallest attention block
    whose page holds a state block. It depends on the state's dtype as vLLM resolves it (128
    tokens with a bfloat16 state here, 256 with a float32 one), so it is read from the plan line,
    and the saved prefixes must end at its multiples."""
    sizes = {int(b) for b in re.findall(r"group \d+ \((\d+)-token blocks\)", log)}
    assert len(sizes) == 1, sizes
    block = sizes.pop()
    assert [(len(p) - 1) // block * block for p in PROMPTS] == SAVED_ENDS, block
    return block


def test_the_test_model_continues_differently_when_one_early_token_changes(
        runs: dict[str, Scenario]) -> None:
    plain = runs["plain"]
    assert plain.tokens(1)[0] != plain.tokens(0)[0]
    assert all(len(set(t)) > 4 for t in plain.tokens(0))


def test_the_hybrid_manager_is_on_with_state_groups_and_the_plan_is_logged_once(
        runs: dict[str, Scenario]) -> None:
    log = runs["first"].log
    lines = [line for line in log.splitlines() if "hybrid KV manager ON" in line]
    assert len(lines) == 1, lines
    assert "NOT CACHING" not in log and "Turning off hybrid kv cache manager" not in log
    assert len(_state_groups(log)) == QWEN3_NEXT["num_hidden_layers"] - 1
    assert "running state (mamba / linear attention), 1 layer: the state block at the saving point" in lines[0]
    assert f"saving points every {_block(log)} tokens" in lines[0]


def test_answers_are_identical_without_galahad_on_first_start_and_after_a_restart(
        runs: dict[str, Scenario]) -> None:
    expected = runs["plain"].tokens()
    assert all(len(t) == MAX_TOKENS for t in expected)
    assert runs["first"].tokens() == expected
    assert runs["restart"].tokens() == expected


def test_the_restarted_process_resumes_every_prompt_from_a_state_loaded_from_disk(
        runs: dict[str, Scenario]) -> None:
    first, restart = runs["first"].counters, runs["restart"].counters
    assert first["saves"] == len(PROMPTS) and first["committed"] == len(PROMPTS), first
    assert restart["hits_disk"] == len(PROMPTS) and restart["loads"] == len(PROMPTS), restart
    assert restart["tokens_loaded"] == sum(SAVED_ENDS)
    assert restart["load_failures"] == 0 and restart["errors"] == 0, restart
    assert [o["num_cached_tokens"] for o in runs["restart"].outputs()] == SAVED_ENDS
    assert len(runs["restart"].tokens(1)[0]) == MAX_TOKENS


def test_an_entry_holds_one_state_block_per_state_layer_whatever_the_prompt_length(
        runs: dict[str, Scenario]) -> None:
    first = runs["first"]
    states, block = _state_groups(first.log), _block(first.log)
    sizes: dict[int, dict[int, int]] = {}
    for path in block_files(first.store):
        header = decode_header(path.read_bytes())
        per_group: dict[int, int] = {}
        for seg in header.segments:
            assert (seg.kind is SegmentKind.STATE) == (seg.group in states)
            assert seg.shape[0] == (1 if seg.group in states else header.token_end // block)
            per_group[seg.group] = per_group.get(seg.group, 0) + seg.nbytes
        sizes[header.token_end] = per_group
    assert sorted(sizes) == SAVED_ENDS
    short, long = sizes[SAVED_ENDS[0]], sizes[SAVED_ENDS[1]]
    assert all(short[g] == long[g] for g in states)
    print(f"\nstate bytes per entry: {sum(short[g] for g in states)} ({len(states)} state layers), "
          f"for a {SAVED_ENDS[0]}- and a {SAVED_ENDS[1]}-token prefix alike; whole entry "
          f"{sum(short.values())} and {sum(long.values())}")


def test_wrong_state_gives_different_tokens(runs: dict[str, Scenario]) -> None:
    perturbed = runs["perturbed"]
    assert "GALAHAD_TEST_PERTURB_LOAD=state" in perturbed.log
    assert perturbed.counters["loads"] == len(PROMPTS)
    for wrong, right in zip(perturbed.tokens(), runs["plain"].tokens()):
        assert wrong != right


def test_a_damaged_state_makes_the_whole_entry_a_miss_and_answers_stay_identical(
        runs: dict[str, Scenario]) -> None:
    damaged = runs["state-damaged"]
    assert damaged.note == len(PROMPTS) * (QWEN3_NEXT["num_hidden_layers"] - 1)  # bytes flipped
    assert damaged.tokens() == runs["plain"].tokens()
    c = damaged.counters
    assert c.get("refused_damaged", 0) == len(PROMPTS) and c["quarantined"] == len(PROMPTS), c
    # no attention block was loaded without its state: nothing loaded at all
    assert c["loads"] == 0 and c["tokens_loaded"] == 0 and c["bytes_loaded"] == 0, c
    assert c["errors"] == 0 and "invalid_block_ids" not in damaged.log
    assert len(damaged.tokens(1)[0]) == MAX_TOKENS


def test_chunk_order_falls_back_to_one_entry_per_prompt_and_says_so(runs: dict[str, Scenario]) -> None:
    chunk = runs["chunk"]
    assert chunk.tokens() == runs["plain"].tokens()
    c = chunk.counters
    assert c["saves"] == len(PROMPTS) and c["committed"] == len(PROMPTS), c
    assert c["saver_chain_fallback"] == len(PROMPTS) and c["saver_chain_saved"] == 0, c
    assert "GALAHAD_PAYLOAD_ORDER=chunk falls back to one entry per prompt" in chunk.log
