"""The public API for custom serving stacks: save a prompt's KV, find and load it back later.

    from galahad import KVLayout, KVStore
    layout = KVLayout(model="my-model", fingerprint=weights_digest, num_layers=28, kv_heads=8,
                      head_dim=128, dtype="bfloat16")
    with KVStore.open("/var/galahad", layout, key_file=..., licence_file=..., issuer_key=...) as store:
        store.save(tokens, kv)                    # kv: per layer (k, v), each [kv_heads, n, head_dim]
        out = store.empty_kv(len(tokens))
        result = store.load(tokens, out)          # result.tokens of out now hold the stored prefix

Stable from this version on: the names in `__all__`, their arguments and results as documented
here and in docs/embedding.md. Everything else in the package may change between versions.

Prompts are stored in pieces of 64 tokens (`KVLayout.align` tokens when that is a larger multiple
of 64), each under a key derived from every token before it, the layout and the `salt`: any
prompt that starts with the same tokens finds the pieces another one saved. A lookup leaves at
least one token to compute, whose logits start the generation. Every load is verified (xxh3-128
checksums, or AES-256-GCM with a key) before a byte reaches `out`.

Caller mistakes (a tensor of the wrong shape, dtype or count, an `out` too small) raise
`ValueError` before the store is touched, and never set an entry aside. Problems of the data
(damaged, sealed under another key, gone, a failing disk) are a shorter or empty result with its
reason, counted, and the entry at fault is set aside so no process reads it again. A store that
cannot cache (no licence, an unusable key or folder) answers every call as a miss and says why in
`reason`, once in the log. Safe to call from several threads of one process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from galahad.bootstrap import CacheHandle, open_cache
from galahad.config import Settings, default_cache_dir
from galahad.domain.chunking import CHUNK_TOKENS
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.app.service import KVCacheService, SegmentSpec

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "KVStore", "LoadResult"]

_DTYPES = ("float16", "bfloat16", "float32")
KV = Sequence[tuple["torch.Tensor", "torch.Tensor"]]


def _positive(name: str) -> Any:
    def check(_self: Any, _attr: Any, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"KVLayout.{name} must be a whole number of at least 1, got {value!r}")
    return check


@attrs.frozen(kw_only=True)
class KVLayout:
    """What a model's KV looks like; everything in it is part of the store's namespace, so two
    processes share entries only when their layouts are equal.

    `model`: a name; `fingerprint`: anything that changes when the weights change (a digest of
    the weights' index, a version tag: a store never serves KV of other weights under the same
    fingerprint). `dtype`: `float16`, `bfloat16` or `float32`. `align`: the piece size in tokens
    if the engine needs coarser pieces than 64 (a multiple of 64, or a divisor of it, meaning 64).
    `tp_rank`, `tp_size`: a model split over several processes, each saving and loading its own
    heads; an entry is committed once every rank's part is stored.
    """

    model: str
    fingerprint: str
    num_layers: int = attrs.field(validator=_positive("num_layers"))
    kv_heads: int = attrs.field(validator=_positive("kv_heads"))
    head_dim: int = attrs.field(validator=_positive("head_dim"))
    dtype: str
    align: int = attrs.field(default=1, validator=_positive("align"))
    tp_rank: int = 0
    tp_size: int = attrs.field(default=1, validator=_positive("tp_size"))

    def __attrs_post_init__(self) -> None:
        if not self.model or not self.fingerprint:
            raise ValueError("KVLayout needs a model name and a fingerprint of its weights")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype={self.dtype!r} is not accepted; use one of: {', '.join(_DTYPES)}")
        if CHUNK_TOKENS % self.align and self.align % CHUNK_TOKENS:
            raise ValueError(f"KVLayout.align={self.align} must divide {CHUNK_TOKENS} or be a multiple of it")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank={self.tp_rank} must be from 0 to tp_size - 1 ({self.tp_size - 1})")

    @property
    def step(self) -> int:
        """Tokens per stored piece: a stored prefix is a multiple of it."""
        return max(CHUNK_TOKENS, self.align)

    def namespace(self) -> Namespace:
        shape = f"kv_heads={self.kv_heads} head_dim={self.head_dim} layout=[kv_heads,tokens,head_dim]"
        return Namespace(model=self.model, model_fingerprint=self.fingerprint, dtype=self.dtype,
                         kv_cache_dtype=self.dtype, block_size=self.align,
                         groups=(KVGroup(GroupKind.FULL, self.align, self.num_layers, spec=shape),),
                         tp_size=self.tp_size, payload_order=PayloadOrder.CHUNK, engine="api")


@attrs.frozen
class LoadResult:
    """What `KVStore.load` put in `out`: the first `tokens` tokens of the prompt (0: none), and
    why not more (`""`: the whole stored prefix was loaded; `miss`: nothing stored; `disabled`:
    the store cannot cache, see `KVStore.reason`; else what the store found: `damaged`, `key`,
    `missing`, `io`, `format`, `namespace`)."""

    tokens: int
    reason: str = ""


class KVStore:
    """A store of prompt KV for one `KVLayout`: `KVStore.open(...)`, then `lookup`, `save`,
    `load`. A context manager; `close()` waits for nothing but the files being released."""

    def __init__(self, layout: KVLayout, handle: CacheHandle) -> None:
        self.layout = layout
        self._service: KVCacheService | None = handle.service
        self._halted: KVCacheService | None = None  # the service, once the licence stopped it
        self.reason = handle.reason  # why this store does not cache ("" when it does)
        self._licence = handle.licence
        self._lock = threading.Lock()
        if self._licence is not None:
            self._licence.start(self._stop)

    @classmethod
    def open(cls, root: str | os.PathLike[str] | None, layout: KVLayout, *, key_file: str | None = None,
             key_command: str | None = None, licence_file: str | None = None, issuer_key: str | None = None,
             max_bytes: int | None = None, min_tokens: int = 0) -> KVStore:
        """Open (or create, mode 0700) the store folder `root` (None: the default,
        `~/.cache/galahad/store`) for `layout`. With `key_file` or `key_command` entries are
        sealed with AES-256-GCM, as the servers' settings of the same names do
        (docs/configuration.md); `licence_file` and `issuer_key` are the licence and its
        issuer's public key. Never raises for a condition of the machine: a store that cannot
        cache has `enabled` False and its `reason`."""
        if key_file and key_command:
            raise ValueError("give key_file or key_command, not both")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be 0 or more, got {min_tokens}")

        def absolute(path: str | os.PathLike[str] | None) -> str | None:
            return None if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))

        settings = Settings(cache_dir=absolute(root) or default_cache_dir(), key_file=absolute(key_file),
                            key_command=key_command, licence_file=absolute(licence_file),
                            licence_issuer_key=absolute(issuer_key), min_tokens=min_tokens,
                            payload_order=PayloadOrder.CHUNK, max_bytes=max_bytes)
        handle = open_cache(settings, layout.namespace(), RankLayout(tp_size=layout.tp_size), role="api",
                            detail=f"min {min_tokens} tokens, pieces of {layout.step} tokens")
        return cls(layout, handle)

    # -- state ----------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._service is not None

    def _stop(self, reason: str) -> None:
        """The licence was refused while in use: from now on every call is a miss (the service
        is closed with the store, so a call running now finishes)."""
        with self._lock:
            self.reason, self._halted, self._service = reason, self._service, None

    def close(self) -> None:
        with self._lock:
            service, self._service = self._service or self._halted, None
            self._halted = None
        if self._licence is not None:
            self._licence.close()
        if service is not None:
            service.close()
        self.reason = self.reason or "closed"

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """The counts since open: lookups, hits_disk, tokens_loaded, saves, bytes_saved,
        load_failures, refused_<reason>, quarantined, ... (as the servers report them)."""
        service = self._service
        if service is None:
            return {}
        counters = service.snapshot_counters()
        out: dict[str, Any] = {f.name: getattr(counters, f.name) for f in attrs.fields(type(counters))
                               if f.name != "refused"}
        out.update({f"refused_{reason}": n for reason, n in counters.refused.items()})
        return out

    # -- the calls ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, salt: str | None = None) -> int:
        """How many tokens of the longest stored prefix of `tokens` (a multiple of
        `layout.step`, at most `len(tokens) - 1`; 0 for none)."""
        tokens = _token_list(tokens)
        service = self._service
        if service is None:
            return 0
        hit = service.lookup(tokens, service.seed(cache_salt=salt))
        service.count(lookups=1)
        return 0 if hit is None else hit.end

    def save(self, tokens: Sequence[int], kv: KV, *, salt: str | None = None) -> int:
        """Store the KV of `tokens` (`kv`: per layer `(k, v)`, each `[kv_heads, n, head_dim]` of
        the layout's dtype, for the first n tokens; n may be less than `len(tokens)`, never more),
        in whole pieces; returns how many tokens of the prompt are now stored and committed
        (pieces already stored count and are not written again). With `tp_size` > 1 a piece is
        committed by the rank that stores its part last."""
        tokens = _token_list(tokens)
        n = self._check_kv(kv, "kv", at_least=0)
        if n > len(tokens):
            raise ValueError(f"kv holds {n} tokens, more than the {len(tokens)} tokens given")
        service = self._service
        if service is None:
            return 0
        seed = service.seed(cache_salt=salt)
        keys = service.keys(tokens[:n], seed)
        spans = [(span, keys[service.chunking.key_index(span.end)]) for span in service.chunking.save_spans(n)]
        for span, key in spans:  # every piece of this rank first: another rank may commit them
            if not service.holds(key):
                service.save_part(key, span, self.layout.tp_rank, self._segments(span.tokens),
                                  _payload(kv, span.start, span.end))
        stored = 0
        for span, key in spans:  # then the stored prefix: the pieces committed, in order
            if not service.commit(key):
                break
            stored = span.end
        return stored

    def load(self, tokens: Sequence[int], out: KV, *, salt: str | None = None) -> LoadResult:
        """Find the longest stored prefix of `tokens` and copy its KV into `out` (per layer
        `(k, v)`, each `[kv_heads, m, head_dim]` with m at least `len(tokens)`: `empty_kv`
        makes one). Only verified bytes are written; pieces load in order and a piece that fails
        ends the result there (the pieces before it are loaded)."""
        tokens = _token_list(tokens)
        self._check_kv(out, "out", at_least=len(tokens))
        service = self._service
        if service is None:
            return LoadResult(0, "disabled")
        hit = service.lookup(tokens, service.seed(cache_salt=salt))
        service.count(lookups=1)
        if hit is None:
            return LoadResult(0, "miss")
        service.count(hits_disk=1)
        loaded, reason = 0, ""
        for span, key in hit.entries:
            part = service.load_part(key, self.layout.tp_rank, segments=self._segments(span.tokens))
            if part is None:
                reason = service.last_miss() or "error"
                break
            _place(out, part.segment_views(), span.start, span.end, self.layout)
            loaded = span.end
        service.count(loads=1 if loaded else 0, tokens_loaded=loaded, load_failures=1 if reason else 0)
        return LoadResult(loaded, reason)

    def empty_kv(self, n_tokens: int, *, device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed `(k, v)` per layer for `n_tokens` tokens, in the layout's shape and dtype."""
        import torch

        if n_tokens < 0:
            raise ValueError(f"n_tokens must be 0 or more, got {n_tokens}")
        shape, dtype = (self.layout.kv_heads, n_tokens, self.layout.head_dim), getattr(torch, self.layout.dtype)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.layout.num_layers)]

    # -- helpers --------------------------------------------------------------------------------

    def _segments(self, n: int) -> list[SegmentSpec]:
        shape = (2, self.layout.kv_heads, n, self.layout.head_dim)
        return [SegmentSpec(0, layer, 0, self.layout.dtype, shape) for layer in range(self.layout.num_layers)]

    def _check_kv(self, kv: KV, name: str, *, at_least: int) -> int:
        """The token count of `kv` (every tensor alike), or ValueError naming what is wrong."""
        import torch

        layout = self.layout
        if len(kv) != layout.num_layers:
            raise ValueError(f"{name} has {len(kv)} layers; the layout has {layout.num_layers}")
        dtype, count = getattr(torch, layout.dtype), None
        for i, pair in enumerate(kv):
            if len(pair) != 2:
                raise ValueError(f"{name}[{i}] must be a (k, v) pair")
            for which, t in zip("kv", pair):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{name}[{i}].{which} is a {type(t).__name__}, not a torch.Tensor")
                if t.dtype != dtype:
                    raise ValueError(f"{name}[{i}].{which} is {t.dtype}; the layout's dtype is {layout.dtype}")
                if t.dim() != 3 or t.shape[0] != layout.kv_heads or t.shape[2] != layout.head_dim:
                    raise ValueError(f"{name}[{i}].{which} has shape {tuple(t.shape)}; expected "
                                     f"[{layout.kv_heads}, tokens, {layout.head_dim}] (kv_heads, tokens, head_dim)")
                if count is None:
                    count = int(t.shape[1])
                elif t.shape[1] != count:
                    raise ValueError(f"{name}[{i}].{which} holds {t.shape[1]} tokens, {name}[0].k {count}")
        count = count or 0
        if count < at_least:
            raise ValueError(f"{name} holds {count} tokens; it needs room for {at_least} "
                             f"(empty_kv({at_least}) makes one)")
        return count


def _token_list(tokens: Sequence[int]) -> list[int]:
    try:
        out = [int(t) for t in tokens]
    except (TypeError, ValueError):
        raise ValueError("tokens must be a sequence of token ids (ints)") from None
    if any(t < 0 for t in out):
        raise ValueError("token ids are never negative")
    return out


def _payload(kv: KV, start: int, end: int) -> list[memoryview]:
    """Per layer, the bytes of `[k; v]` for tokens [start, end): shape (2, kv_heads, n, head_dim)."""
    import torch

    out = []
    for k, v in kv:
        piece = torch.stack((k[:, start:end], v[:, start:end])).detach().to("cpu").contiguous()
        out.append(memoryview(piece.view(-1).view(torch.uint8).numpy()))
    return out


def _place(out: KV, views: Sequence[memoryview], start: int, end: int, layout: KVLayout) -> None:
    """Copy one verified piece (a view per layer) into `out` at tokens [start, end)."""
    import torch

    dtype = getattr(torch, layout.dtype)
    shape = (2, layout.kv_heads, end - start, layout.head_dim)
    for (k, v), view in zip(out, views):
        piece = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        piece = piece.view(dtype).view(shape)
        k[:, start:end].copy_(piece[0])
        v[:, start:end].copy_(piece[1])
