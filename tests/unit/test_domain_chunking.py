"""Saving and sharing points (domain/chunking.py)."""

from __future__ import annotations

import pytest

from galahad.domain.chunking import CHUNK_TOKENS, DEFAULT_MIN_TOKENS, Chunking, Span
from galahad.domain.error import ConfigError
from galahad.domain.namespace import PayloadOrder

LAYER, CHUNK = PayloadOrder.LAYER, PayloadOrder.CHUNK


def test_layer_order_saves_one_block_aligned_prefix() -> None:
    c = Chunking(LAYER, block_size=16)
    assert c.step == 16 and not c.is_fallback
    assert c.save_spans(300) == [Span(0, 288)]
    assert c.save_spans(300)[0].tokens == 288


def test_chunk_order_saves_every_64_tokens_when_the_block_divides_64() -> None:
    c = Chunking(CHUNK, block_size=16)
    assert c.step == CHUNK_TOKENS and not c.is_fallback
    assert c.save_spans(300) == [Span(0, 64), Span(64, 128), Span(128, 192), Span(192, 256)]


def test_chunk_order_falls_back_to_the_block_size_for_coarse_blocks() -> None:
    c = Chunking(CHUNK, block_size=128)
    assert c.step == 128 and c.is_fallback
    assert c.save_spans(400) == [Span(0, 128), Span(128, 256), Span(256, 384)]


@pytest.mark.parametrize("block_size", [48, 96, 100])
def test_chunk_order_refuses_a_block_size_neither_dividing_nor_a_multiple_of_64(block_size: int) -> None:
    with pytest.raises(ConfigError, match="GALAHAD_PAYLOAD_ORDER=chunk"):
        Chunking(CHUNK, block_size=block_size)
    assert Chunking(LAYER, block_size=block_size).step == block_size  # layer order takes any size


@pytest.mark.parametrize("block_size, min_tokens", [(0, 0), (-16, 0), (16, -1)])
def test_nonsense_sizes_are_refused(block_size: int, min_tokens: int) -> None:
    with pytest.raises(ConfigError):
        Chunking(LAYER, block_size=block_size, min_tokens=min_tokens)


def test_short_prompts_are_neither_saved_nor_looked_up() -> None:
    c = Chunking(LAYER, block_size=16)
    assert c.min_tokens == DEFAULT_MIN_TOKENS
    assert not c.eligible(DEFAULT_MIN_TOKENS - 1)
    assert c.save_spans(DEFAULT_MIN_TOKENS - 1) == [] and c.probe_ends(DEFAULT_MIN_TOKENS - 1) == []
    assert c.eligible(DEFAULT_MIN_TOKENS)
    assert not Chunking(CHUNK, block_size=256, min_tokens=0).eligible(255)  # below one step


def test_probes_run_longest_first_and_leave_a_token_to_compute() -> None:
    c = Chunking(LAYER, block_size=16, min_tokens=0)
    assert c.probe_ends(64) == [48, 32, 16]
    assert c.probe_ends(64, leave_one=False) == [64, 48, 32, 16]
    assert c.probe_ends(65) == [64, 48, 32, 16]


def test_span_and_key_index_of_a_saving_point() -> None:
    layer, chunk = Chunking(LAYER, block_size=16), Chunking(CHUNK, block_size=16)
    assert layer.span_ending_at(48) == Span(0, 48)
    assert chunk.span_ending_at(192) == Span(128, 192)
    assert layer.key_index(48) == 2 and chunk.key_index(192) == 2
    with pytest.raises(ValueError):
        chunk.span_ending_at(100)
