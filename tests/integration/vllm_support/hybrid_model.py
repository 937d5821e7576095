"""Small hybrid test models built locally (random weights, no model hub).

- `build_gemma3`: a Gemma3 text model whose sliding-window layers keep a window of a few blocks
  and one full-attention layer: vLLM's hybrid KV manager gives it a sliding-window group and a
  full-attention group.
- `build_qwen3_next`: a Qwen3-Next model (gated delta net "linear attention" layers plus one full
  attention layer): a mamba-state group and a full-attention group. vLLM's CPU build runs it with
  head_dim 64 (not 32).
- `build_llama4_chunked`: a Llama4 text model with chunked local attention layers, a group kind
  Galahad does not plan (its connector refuses to cache it; vLLM serves it normally).

Both are scaled (`init_std`; Gemma3's output head untied from its embeddings, else greedy output
is one token repeated) so greedy output depends on the context, use the demo's word-level
tokenizer, and are cached in a folder named by a hash of their parameters
(`galahad.cli.demo.build_cached`).
"""

from __future__ import annotations

from pathlib import Path

from galahad.cli.demo import build_cached
from vllm_support.model import ModelSpec

__all__ = ["GEMMA3", "LLAMA4_CHUNKED", "QWEN3_NEXT", "build_gemma3", "build_llama4_chunked", "build_qwen3_next"]

GEMMA3 = ModelSpec(
    arch="gemma3", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128, init_std=0.1,
    tie_word_embeddings=False, seed=0,
)
QWEN3_NEXT = ModelSpec(
    arch="qwen3_next", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    init_std=0.1, gdn_a_log=-7.0, seed=0,
)

LLAMA4_CHUNKED = ModelSpec(
    arch="llama4", vocab_size=2048, hidden_size=256, intermediate_size=256, intermediate_size_mlp=512,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    attention_chunk_size=128, seed=0,
)


def build_gemma3(spec: ModelSpec = GEMMA3) -> str:
    """3 sliding-window layers (window `spec["sliding_window"]` tokens) and 1 full-attention layer."""

    def write(folder: Path) -> None:
        import torch
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        torch.manual_seed(spec["seed"])
        cfg = Gemma3TextConfig(
            vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
            intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
            num_attention_heads=spec["num_attention_heads"],
            num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
            sliding_window=spec["sliding_window"], query_pre_attn_scalar=spec["head_dim"],
            layer_types=["sliding_attention"] * (spec["num_hidden_layers"] - 1) + ["full_attention"],
            max_position_embeddings=8192, initializer_range=spec["init_std"],
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
            torch_dtype="float32",
        )
        Gemma3ForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)

    return build_cached("gemma3", spec, write)


def build_qwen3_next(spec: ModelSpec = QWEN3_NEXT) -> str:
    """3 gated-delta-net (linear attention) layers and 1 full-attention layer, a small MoE.

    The delta net's decay is set slow (`A_log`; the default forgets within a few tokens), so the
    state at a saving point shapes the next tokens: a test that restores a wrong state sees it.
    """

    def write(folder: Path) -> None:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        torch.manual_seed(spec["seed"])
        n = spec["num_hidden_layers"]
        cfg = Qwen3NextConfig(
            vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
            intermediate_size=spec["intermediate_size"], num_hidden_layers=n,
            num_attention_heads=spec["num_attention_heads"],
            num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
            linear_key_head_dim=spec["linear_key_head_dim"],
            linear_value_head_dim=spec["linear_value_head_dim"],
            linear_num_key_heads=spec["linear_num_key_heads"],
            linear_num_value_heads=spec["linear_num_value_heads"],
            num_experts=spec["num_experts"], num_experts_per_tok=spec["num_experts_per_tok"],
            moe_intermediate_size=spec["moe_intermediate_size"],
            shared_expert_intermediate_size=spec["shared_expert_intermediate_size"],
            layer_types=["linear_attention"] * (n - 1) + ["full_attention"],
            max_position_embeddings=8192, initializer_range=spec["init_std"],
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
        )
        model = Qwen3NextForCausalLM(cfg)
        with torch.no_grad():  # slow decay: the state remembers hundreds of tokens, so it matters
            for name, param in model.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    param.fill_(spec["gdn_a_log"])
        model.save_pretrained(str(folder), safe_serialization=True)

    return build_cached("qwen3next", spec, write)


def build_llama4_chunked(spec: ModelSpec = LLAMA4_CHUNKED) -> str:
    """3 chunked-local-attention layers (chunks of `attention_chunk_size` tokens) and 1 full one."""

    def write(folder: Path) -> None:
        import torch
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        torch.manual_seed(spec["seed"])
        n = spec["num_hidden_layers"]
        cfg = Llama4TextConfig(
            vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
            intermediate_size=spec["intermediate_size"],
            intermediate_size_mlp=spec["intermediate_size_mlp"], num_hidden_layers=n,
            num_attention_heads=spec["num_attention_heads"],
            num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
            num_local_experts=2, num_experts_per_tok=1, moe_layers=[], interleave_moe_layer_step=0,
            no_rope_layers=[1] * (n - 1) + [0], attention_chunk_size=spec["attention_chunk_size"],
            layer_types=["chunked_attention"] * (n - 1) + ["full_attention"],
            max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False,
        )
        model = Llama4ForCausalLM(cfg)
        model.config.architectures = ["Llama4ForCausalLM"]
        model.save_pretrained(str(folder), safe_serialization=True)

    return build_cached("llama4chunked", spec, write)
