"""Counters: what the connector and backend report. Plain ints and floats, mergeable across ranks."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Counters", "MissReason"]


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

    def refuse(self, reason: str, count: int = 1) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + count

    def merge(self, other: Counters) -> None:
        for field in attrs.fields(Counters):
            if field.name == "refused":
                for reason, n in other.refused.items():
                    self.refuse(reason, n)
            else:
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def hit_rate(self) -> float:
        """Share of lookups that found something on disk, in percent."""
        return 100.0 * self.hits_disk / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in attrs.fields(Counters):
            if field.name != "refused":
                out[field.name] = getattr(self, field.name)
        for reason, n in sorted(self.refused.items()):
            out[f"refused_{reason}"] = n
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        c = cls()
        names = {f.name for f in attrs.fields(Counters)}
        for key, value in data.items():
            if key.startswith("refused_"):
                c.refuse(key[len("refused_") :], int(value))
            elif key in names and key != "refused":
                setattr(c, key, value)
        return c

    def take(self) -> Counters:
        """Return the counts so far and reset to zero."""
        snapshot = attrs.evolve(self, refused=dict(self.refused))
        for field in attrs.fields(Counters):
            setattr(self, field.name, {} if field.name == "refused" else type(getattr(self, field.name))())
        return snapshot

    def is_empty(self) -> bool:
        return not any(v for v in self.as_dict().values())
