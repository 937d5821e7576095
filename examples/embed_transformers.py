"""Galahad in a custom generation loop: a Hugging Face `transformers` model, greedy decoding.

    python examples/embed_transformers.py STORE --licence FILE --issuer-key FILE [--key-file FILE]
                                          [--model DIR] [--prompt-tokens 300] [--new-tokens 16]
                                          [--no-cache] [--perturb]

Each run builds (once, into --model) a small Qwen3 model with random weights, takes a fixed
prompt, and asks the store for its longest stored prefix. What is found is loaded into the
model's KV cache and only the rest of the prompt is computed; what is not found is computed and
saved for the next process. Then it generates greedily and prints one JSON line: the tokens
generated, how many prompt tokens were loaded, and why not more. Run it twice: the second process
loads the prefix the first one saved, and generates the same tokens.

`--no-cache` runs without Galahad (the reference); `--perturb` negates the loaded KV before use
(the tokens then differ: a check that the loaded KV is what the answer is made of).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from galahad import KVLayout, KVStore
def build_model(folder: Path) -> Qwen3ForCausalLM:
    """The model in `folder`, built there with random weights the first time."""
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             initializer_range=0.08, tie_word_embeddings=False)
        Qwen3ForCausalLM(config).save_pretrained(str(folder))
    return Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def fingerprint(folder: Path) -> str:
    """Changes whenever the weights do: a store never serves KV of other weights."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in folder.iterdir() if p.suffix in (".json", ".safetensors")):
        digest.update(name.encode() + (folder / name).read_bytes())
    return digest.hexdigest()


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s (k, v) of batch row 0: [kv_heads, tokens, head_dim]."""
    return cache.layers[layer].keys[0], cache.layers[layer].values[0]


@torch.inference_mode()
def generate(model: Qwen3ForCausalLM, prompt: list[int], new_tokens: int, store: KVStore | None,
             perturb: bool = False) -> dict[str, object]:
    cache, loaded, reason = DynamicCache(config=model.config), 0, "no store"
    if store is not None:
        out = store.empty_kv(len(prompt))
        result = store.load(prompt, out)
        loaded, reason = result.tokens, result.reason
        for layer, (k, v) in enumerate(out):
            k, v = k[:, :loaded], v[:, :loaded]
            if perturb:
                k, v = -k, -v
            cache.update(k.unsqueeze(0).clone(), v.unsqueeze(0).clone(), layer)
    logits = model(input_ids=torch.tensor([prompt[loaded:]]), past_key_values=cache, use_cache=True).logits
    if store is not None and loaded < len(prompt):
        layers = model.config.num_hidden_layers
        store.save(prompt, [layer_kv(cache, i) for i in range(layers)])
    tokens = []
    for _ in range(new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return {"tokens": tokens, "loaded": loaded, "reason": reason}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--licence", required=True)
    ap.add_argument("--issuer-key", required=True)
    ap.add_argument("--key-file")
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "galahad" / "example-model"))
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--perturb", action="store_true")
    args = ap.parse_args()

    folder = Path(args.model)
    model = build_model(folder)
    rng = random.Random(7)
    prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(args.prompt_tokens)]
    if args.no_cache:
        print(json.dumps(generate(model, prompt, args.new_tokens, None)))
        return
    cfg = model.config
    layout = KVLayout(model="example-qwen3", fingerprint=fingerprint(folder), num_layers=cfg.num_hidden_layers,
                      kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype="float32")
    with KVStore.open(args.store, layout, key_file=args.key_file, licence_file=args.licence,
                      issuer_key=args.issuer_key) as store:
        if not store.enabled:
            print(f"not caching: {store.reason}")
        print(json.dumps(generate(model, prompt, args.new_tokens, store, args.perturb)))


if __name__ == "__main__":
    main()
