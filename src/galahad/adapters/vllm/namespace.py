"""The namespace of a vLLM engine: what must match for stored KV to be valid here.

Built identically in the scheduler process and in every worker (both see the same `VllmConfig`
and `KVCacheConfig`), so the digest the scheduler seeds chain keys with is the digest the workers
write in block headers.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.plan import StatePlan
from galahad.domain.rank import RankLayout

__all__ = ["HybridPlanUnavailable", "groups_of", "model_fingerprint", "namespace_of", "rank_layout_of"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_INDEX_NAMES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class HybridPlanUnavailable(Exception):
    """The model's KV cache groups are not (yet) all ones Galahad can save and restore."""


def model_fingerprint(model: str, revision: str | None, hf_config_json: str) -> str:
    """SHA-256 over config.json, the weights index and every weight file's name and size.

    A hub id that is not a local folder is fingerprinted by its id, revision and config.
    """
    h = hashlib.sha256(b"galahad-model-v1\x00")
    if os.path.isdir(model):
        names = sorted(os.listdir(model))
        for name in names:
            path = os.path.join(model, name)
            if name in _INDEX_NAMES:
                with open(path, "rb") as f:
                    h.update(name.encode() + b"\x00" + hashlib.sha256(f.read()).digest())
            elif name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(path):
                h.update(f"{name}\x00{os.path.getsize(path)}\x00".encode())
    else:
        h.update(f"{model}\x00{revision or ''}\x00".encode())
        h.update(hf_config_json.encode())
    return h.hexdigest()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _attention_desc(name: str, spec: Any) -> str:
    return (f"{name}(heads={spec.num_heads},head={spec.head_size},head_v={spec.head_size_v},"
            f"dtype={_dtype_name(spec.dtype)},page={spec.page_size_bytes},"
            f"quant={int(spec.kv_quant_mode)})")


def _group_of(spec: Any, num_layers: int) -> KVGroup:
    """The `KVGroup` of one engine group; `HybridPlanUnavailable` for anything not saved exactly.

    Only the exact spec classes below are planned (a subclass may change what a block holds):
    full attention (and MLA) without a window; a sliding window with nothing retained below it;
    a mamba / linear-attention state in vLLM's `align` prefix-caching mode (one state per block,
    checkpointed at block boundaries) without speculative blocks.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    name = type(spec).__name__
    if isinstance(spec, FullAttentionSpec) and name in _FULL_SPECS:
        if spec.sliding_window or spec.attention_chunk_size:
            raise HybridPlanUnavailable(f"{name} with a window or chunked attention")
        return KVGroup(GroupKind.FULL, spec.block_size, num_layers, spec=_attention_desc(name, spec))
    if isinstance(spec, SlidingWindowSpec) and name == "SlidingWindowSpec":
        if getattr(spec, "extra_retained_tokens", 0):
            raise HybridPlanUnavailable(f"a {name} group retaining {spec.extra_retained_tokens} "
                                        "tokens below its window")
        desc = _attention_desc(name, spec) + f"[window={spec.sliding_window}]"
        return KVGroup(GroupKind.SLIDING, spec.block_size, num_layers,
                       window_tokens=spec.sliding_window, spec=desc)
    if isinstance(spec, MambaSpec) and name == "MambaSpec":
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise HybridPlanUnavailable(
                f"a {name} group in mamba_cache_mode {mode!r} (vLLM keeps a state "
                "per block only in 'align' mode, with prefix caching on)")
        if getattr(spec, "num_speculative_blocks", 0):
            raise HybridPlanUnavailable(f"a {name} group with speculative blocks")
        shapes = ",".join("x".join(map(str, s)) for s in spec.shapes)
        dtypes = ",".join(_dtype_name(d) for d in spec.dtypes)
        desc = (f"{name}(type={getattr(spec.mamba_type, 'value', spec.mamba_type)},shapes={shapes},"
                f"dtypes={dtypes},page={spec.page_size_bytes},mode={mode})")
        return KVGroup(GroupKind.STATE, spec.block_size, num_layers, spec=desc)
    raise HybridPlanUnavailable(f"a {name} group")


def groups_of(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """One `KVGroup` per KV cache group; raises `HybridPlanUnavailable` for groups not supported."""
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        if getattr(group, "host_resident", False) or not getattr(group, "enable_kv_transfer", True):
            raise HybridPlanUnavailable("a host-resident or non-transferable group")
        if getattr(group, "is_eagle_group", False):
            raise HybridPlanUnavailable("a speculative-decoding (eagle) group")
        groups.append(_group_of(group.kv_cache_spec, len(group.layer_names)))
    if not groups:
        raise HybridPlanUnavailable("no KV cache groups")
    sizes = sorted({g.block_size for g in groups})
    if len(sizes) > 1:
        raise HybridPlanUnavailable(f"KV cache groups with different block sizes {sizes}")
    if not any(g.kind is not GroupKind.STATE for g in groups):
        raise HybridPlanUnavailable("no attention group")
    return tuple(groups)


def _cpu_isa(model_config: Any, cache_config: Any, group: KVGroup, head_size: int) -> str:
    try:
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":
            return ""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(model_config.dtype, group.block_size, head_size,
                                 cache_config.cache_dtype))
    except Exception:  # noqa: BLE001 - an unknown ISA only makes the namespace stricter
        return "unknown"


def cannot_resume(vllm_config: Any) -> str:
    """Why this engine cannot compute the rest of a prompt on top of KV loaded for its start
    ("" when it can). vLLM's CPU build has no MLA attention over cached tokens: it turns prefix
    caching and chunked prefill off for such a model, and a load there changes the answers."""
    if not getattr(vllm_config.model_config, "use_mla", False):
        return ""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return ("vLLM's CPU build computes MLA attention only over a whole prompt (it turns prefix "
                "caching off for this model), so KV loaded for a prompt's start cannot be used")
    return ""


def rank_layout_of(vllm_config: Any, kv_cache_config: Any) -> RankLayout:
    """The TP x PP layout, with how many consecutive TP ranks hold identical KV (stored once).

    vLLM says so for MLA-style caches (`kv_tp_replicas`, `use_mla`). With fewer KV heads than TP
    ranks (and no decode context parallel) vLLM replicates each head on tp / heads consecutive
    ranks without marking it; Galahad counts those replicas itself.
    """
    par, mc = vllm_config.parallel_config, vllm_config.model_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if mc.use_mla:
        return RankLayout(tp, pp, replicated=True)
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
    if replicas <= 1 and int(getattr(par, "decode_context_parallel_size", 1) or 1) == 1:
        heads = int(mc.get_total_num_kv_heads())
        if 0 < heads < tp and tp % heads == 0:
            replicas = tp // heads
    if replicas < 1 or tp % replicas:
        replicas = 1
    return RankLayout(tp, pp, tp_replicas=replicas)


def namespace_of(vllm_config: Any, kv_cache_config: Any, order: PayloadOrder) -> Namespace:
    """The namespace of this engine; raises `HybridPlanUnavailable` for unsupported group plans."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = groups_of(kv_cache_config)
    first = next(i for i, g in enumerate(groups) if g.kind is not GroupKind.STATE)
    spec0 = kv_cache_config.kv_cache_groups[first].kv_cache_spec
    model = mc.model.rstrip("/")
    dtype = _dtype_name(mc.dtype)
    kv_dtype = dtype if cc.cache_dtype in (None, "auto") else str(cc.cache_dtype)
    try:
        import vllm

        version = str(vllm.__version__)
    except Exception:  # noqa: BLE001
        version = "unknown"
    extra = {
        "platform": str(current_platform.device_type),
        "attn_isa": _cpu_isa(mc, cc, groups[first], spec0.head_size),
        "vllm": version,
        "quantization": str(mc.quantization or ""),
        "weights": "dummy" if str(vllm_config.load_config.load_format) == "dummy" else "",
        "dcp": str(getattr(pc, "decode_context_parallel_size", 1)),
        # what `StatePlan` saves of each group: a change of the rule is a new namespace
        "hybrid_plan": "1" if StatePlan(groups).is_hybrid else "",
    }
    return Namespace(
        model=os.path.basename(model) if os.path.isdir(model) else model,
        model_fingerprint=model_fingerprint(model, mc.revision, _hf_json(mc)),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        block_size=groups[0].block_size,
        groups=groups,
        tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size,
        kv_layout=str(getattr(kv_cache_config, "kv_cache_layout", None) or cc.kv_cache_layout or ""),
        payload_order=order,
        engine="vllm",
        extra=tuple(sorted((k, v) for k, v in extra.items() if v)),
    )


def _hf_json(model_config: Any) -> str:
    try:
        return json.dumps(model_config.hf_config.to_dict(), sort_keys=True, default=str)
    except Exception:  # noqa: BLE001
        return ""
