"""A small, context-sensitive test model built locally (no model hub).

A Qwen3 config with random weights, scaled so greedy output depends on the whole context (two
prompts that differ in one early token continue differently), and a word-level tokenizer whose
vocabulary is `w0 .. w{V-1}`: a prompt of N words is exactly N tokens. The build is cached in a
folder named by a hash of its parameters, so tests and the demo reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = ["ModelSpec", "SMALL", "BENCH", "build_model", "prompt_ids", "prompt_text"]

SPECIAL = ["<unk>", "<s>", "</s>"]


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


def _digest(spec: ModelSpec) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _cache_root() -> Path:
    base = os.environ.get("GALAHAD_TEST_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "galahad", "test-models"
    )
    return Path(base)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(len(SPECIAL), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(folder))


def _write_model(folder: Path, spec: ModelSpec) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = Qwen3Config(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"], initializer_range=spec["init_std"],
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=spec["dtype"],
    )
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, spec["dtype"]))
    model.save_pretrained(str(folder), safe_serialization=True)


def build_model(spec: ModelSpec = SMALL) -> str:
    """Build (once) and return the folder of a local model for `spec`."""
    folder = _cache_root() / f"qwen3-{_digest(spec)}"
    if (folder / "done").exists():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".build-"))
    try:
        _write_model(tmp, spec)
        _write_tokenizer(tmp, spec["vocab_size"])
        (tmp / "galahad-test-model.json").write_text(json.dumps(spec, sort_keys=True))
        (tmp / "done").write_text("ok\n")
        try:
            tmp.rename(folder)
        except OSError:  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(folder)


def prompt_ids(length: int, seed: int, vocab_size: int = SMALL["vocab_size"]) -> list[int]:
    """A reproducible random prompt of `length` ordinary token ids."""
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIAL), vocab_size) for _ in range(length)]


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

