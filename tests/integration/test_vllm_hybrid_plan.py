"""Which vLLM KV cache group layouts Galahad plans, and the reason it gives for the others.

Built from vLLM 0.32's own spec classes (no engine started): the plan of a group is exact or
refused, never guessed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from galahad.adapters.vllm.namespace import HybridPlanUnavailable, groups_of  # noqa: E402
from galahad.domain.namespace import GroupKind  # noqa: E402

ATTN: dict[str, Any] = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def _config(*specs: Any, **group: Any) -> Any:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"], **group) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def _mamba(block_size: int = 256, **kw: Any) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((3, 256), (4, 64, 64)),
                     dtypes=(torch.bfloat16, torch.float32), **kw)


def test_sliding_window_state_and_full_attention_groups_are_planned() -> None:
    groups = groups_of(_config(SlidingWindowSpec(block_size=32, sliding_window=128, **ATTN),
                               FullAttentionSpec(block_size=32, **ATTN)))
    assert [(g.kind, g.window_tokens) for g in groups] == [(GroupKind.SLIDING, 128), (GroupKind.FULL, 0)]
    state = groups_of(_config(_mamba(mamba_cache_mode="align"), FullAttentionSpec(block_size=256, **ATTN)))
    assert [g.kind for g in state] == [GroupKind.STATE, GroupKind.FULL]


@pytest.mark.parametrize(("specs", "reason"), [
    ((ChunkedLocalAttentionSpec(block_size=32, attention_chunk_size=128, **ATTN),),
     "a ChunkedLocalAttentionSpec group"),
    ((FullAttentionSpec(block_size=32, sliding_window=128, **ATTN),),
     "FullAttentionSpec with a window or chunked attention"),
    ((_mamba(mamba_cache_mode="none"), FullAttentionSpec(block_size=256, **ATTN)),
     "mamba_cache_mode 'none'"),
    ((_mamba(mamba_cache_mode="align", num_speculative_blocks=1), FullAttentionSpec(block_size=256, **ATTN)),
     "with speculative blocks"),
    ((SlidingWindowSpec(block_size=32, sliding_window=128, extra_retained_tokens=2, **ATTN),),
     "retaining 2 tokens below its window"),
    ((SlidingWindowMLASpec(block_size=32, sliding_window=128, **ATTN),), "a SlidingWindowMLASpec group"),
    ((SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN), FullAttentionSpec(block_size=32, **ATTN)),
     "different block sizes [16, 32]"),
    ((_mamba(mamba_cache_mode="align"),), "no attention group"),
])
def test_a_group_layout_galahad_cannot_save_exactly_is_refused_with_its_reason(
        specs: tuple[Any, ...], reason: str) -> None:
    with pytest.raises(HybridPlanUnavailable, match=None) as refused:
        groups_of(_config(*specs))
    assert reason in str(refused.value)


def test_speculative_decoding_groups_are_refused() -> None:
    with pytest.raises(HybridPlanUnavailable, match="eagle"):
        groups_of(_config(FullAttentionSpec(block_size=32, **ATTN), is_eagle_group=True))
