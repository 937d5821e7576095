"""Counters: what the connector and backend report. Plain ints and floats, mergeable across ranks."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Counters", "MissReason", "SkipReason"]


class MissReason:
    """Reasons a stored block was refused (a miss), as counter suffixes `refused_<reason>`."""

    NAMESPACE = "namespace"  # a file of another namespace, rank or world size
    KEY = "key"  # sealed under a key we do not hold
    DAMAGED = "damaged"  # header or frame failed its checksum or tag, or a truncated file
    FORMAT = "format"  # not a Galahad block, or a future major version
    IO = "io"  # the medium failed to read
    MISSING = "missing"  # a committed entry's part vanished
    INJECTED = "injected"  # a test-only fault (GALAHAD_FAULT_LOAD_RATE)
    ERROR = "error"  # Galahad's own load path raised (logged with its traceback): a bug to report


class SkipReason:
    """Why a part was not saved, as counter suffixes `saves_skipped_<reason>` (each also counts
    in `saves_skipped`). A skipped save loses nothing but a future hit."""

    BACKLOG = "backlog"  # save work in flight at its bound: the disk or the cipher is slower than the engine
    STORE = "store"  # the store refused the write (full, read-only, not answering)
    FORMAT = "format"  # the part cannot be encoded
    FREED = "freed"  # vLLM had already freed a block the save needed (a sliding window moved on)
    EXIT = "exit"  # the server was stopping before the save started: its entry could not be committed


@attrs.define
class Counters:
    """Per-report counters (deltas): each report is taken with `take()`, which resets them."""

    lookups: int = 0
    hits_disk: int = 0
    loads: int = 0
    chain_hits: int = 0
    bypassed: int = 0
    hits_recomputed: int = 0  # hits recomputed because loading was priced slower (also `bypassed`)
    saver_chain_saved: int = 0
    saver_chain_fallback: int = 0
    saves: int = 0
    saves_skipped: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    save_wait_seconds: float = 0.0  # saves held back while loads ran (`galahad.app.priority`)
    load_failures: int = 0
    held_loads: int = 0  # entries loaded from the copy of a save not yet durable (pending loads)
    preloaded: int = 0  # parts read ahead into memory when the worker started (`GALAHAD_PRELOAD_BYTES`)
    preloaded_loads: int = 0  # entries loaded from those parts, with nothing read then
    quarantined: int = 0
    evicted: int = 0
    namespace_misses: int = 0  # lookups that missed here while another TP x PP layout holds the prompt
    refused: dict[str, int] = attrs.Factory(dict)
    skipped: dict[str, int] = attrs.Factory(dict)  # `saves_skipped` by reason (`SkipReason`)

    def refuse(self, reason: str, count: int = 1) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + count

    def skip(self, reason: str, count: int = 1) -> None:
        """Count `count` saves skipped for `reason` (in `saves_skipped` too)."""
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        self.saves_skipped += count

    @property
    def hit_rate(self) -> float:
        """Share of lookups that found something on disk, in percent."""
        return 100.0 * self.hits_disk / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in attrs.fields(Counters):
            if field.name not in _BY_REASON:
                out[field.name] = getattr(self, field.name)
        for name, prefix in _BY_REASON.items():
            for reason, n in sorted(getattr(self, name).items()):
                out[prefix + reason] = n
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        c = cls()
        names = {f.name for f in attrs.fields(Counters)}
        for key, value in data.items():
            by_reason = next((name for name, prefix in _BY_REASON.items() if key.startswith(prefix)), None)
            if by_reason is not None:  # a per-reason count; its total has a field of its own
                getattr(c, by_reason)[key[len(_BY_REASON[by_reason]) :]] = int(value)
            elif key in names and key not in _BY_REASON:
                setattr(c, key, value)
        return c

    def copy(self) -> Counters:
        return attrs.evolve(self, refused=dict(self.refused), skipped=dict(self.skipped))

    def is_empty(self) -> bool:
        return not any(v for v in self.as_dict().values())


# counts kept per reason (field: the prefix of their names when reported, `<prefix><reason>`)
_BY_REASON = {"refused": "refused_", "skipped": "saves_skipped_"}
