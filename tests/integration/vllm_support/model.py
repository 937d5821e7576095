"""A small, context-sensitive test model built locally (no model hub).

A Qwen3 config with random weights, scaled so greedy output depends on the whole context (two
prompts that differ in one early token continue differently), and a word-level tokenizer whose
vocabulary is `w0 .. w{V-1}`: a prompt of N words is exactly N tokens. The builder is the demo's
(`galahad.cli.demo.build_model`), cached in a folder named by a hash of its parameters, so tests and
the demo reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

from galahad.cli.demo import build_model as _build_qwen3
from galahad.cli.demo import prompt_ids as _prompt_ids

__all__ = ["ModelSpec", "SMALL", "BENCH", "build_model", "prompt_ids", "prompt_text"]


class ModelSpec(dict):  # a dict so it hashes into a stable folder name
    """Parameters of a test model (Qwen3 architecture)."""


SMALL = ModelSpec(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, init_std=0.1,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)
BENCH = ModelSpec(
    vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, init_std=0.05,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)


def build_model(spec: ModelSpec = SMALL) -> str:
    """Build (once) and return the folder of a local model for `spec` (the demo's builder)."""
    return _build_qwen3(spec)


def prompt_ids(length: int, seed: int, vocab_size: int = SMALL["vocab_size"]) -> list[int]:
    """A reproducible random prompt of `length` ordinary token ids (`galahad.cli.demo.prompt_ids`)."""
    return _prompt_ids(length, seed, vocab_size)


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def build_lora(model_dir: str, *, rank: int = 8, seed: int = 1, scale: float = 0.05) -> str:
    """A PEFT-format LoRA adapter for the test model (q/k/v/o projections, random A and B), cached."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    folder = Path(model_dir + f"-lora-r{rank}-s{seed}")
    if (folder / "done").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv, hd = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["head_dim"])
    shapes = {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd), "v_proj": (hidden, kv * hd),
              "o_proj": (heads * hd, hidden)}
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank * 2,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(shapes),
        "base_model_name_or_path": model_dir, "fan_in_fan_out": False, "modules_to_save": None,
    }))
    (folder / "done").write_text("ok\n")
    return str(folder)

