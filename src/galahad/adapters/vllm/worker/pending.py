"""Pending loads: the copies that saves not yet durable hold, and loads served from them.

A save's copy of an entry (the pinned buffer it was gathered into, or on the byte path its rows)
is kept until its part is durable; meanwhile the worker reports the entry `held`, and a load of
it copies it in from there (counted `held_loads`), with no read of the disk: the disk may take
seconds to make a turn's saves durable, and the conversation's next turn should not wait for it
or recompute.
"""

from __future__ import annotations

import threading

from galahad.adapters.vllm.metadata import EntryRef
from galahad.adapters.vllm.worker.context import WorkerContext
from galahad.adapters.vllm.worker.parts import HeldBuffer, HeldPart, Hold, ReadPart, SaveCopy, Source

__all__ = ["PendingSaves"]


class PendingSaves:
    """The holds of one worker, by key. Off (nothing held) on a rank that does not write."""

    def __init__(self, ctx: WorkerContext, enabled: bool) -> None:
        self._ctx = ctx
        self.enabled = enabled
        self._lock = threading.Lock()
        self._held: dict[bytes, Hold] = {}

    def __len__(self) -> int:
        return len(self._held)

    def holds(self) -> list[Hold]:
        with self._lock:
            return list(self._held.values())

    def hold(self, key: bytes, hold: Hold) -> None:
        """Keep `hold` as the copy loads of `key` use until its save is over; reported `held`."""
        if not self.enabled:
            return
        with self._lock:
            self._held[key] = hold
        self._ctx.report.held.setdefault(key, []).append(self._ctx.rank)

    def unhold(self, key: bytes) -> None:
        with self._lock:
            self._held.pop(key, None)

    def written(self, key: bytes, copy: SaveCopy | None) -> None:
        """An entry's save is over (durable, or given up): loads read the disk from now on, and
        the save's copy goes back once no load reads it."""
        self.unhold(key)
        if copy is not None:
            copy.written()

    def take(self, entry: EntryRef) -> ReadPart | None:
        """The entry as the copy of its pending save holds it, if this worker holds one of its
        span; a CUDA copy is kept from going back to the pool until the load gives it back."""
        if not self.enabled:
            return None
        nrows = self._ctx.nrows(entry)
        with self._lock:
            hold = self._held.get(entry.key)
            if hold is None or hold.nrows != nrows:
                return None
            if hold.copy is not None:
                hold.copy.read()
        if hold.copy is not None and hold.host is not None:
            hold.copy.gathered.wait()  # its copy to the host (queued in an earlier step) is done
            read = ReadPart(HeldPart(hold.nbytes, []), Source.HELD, HeldBuffer(hold.copy, hold.host))
        else:
            read = ReadPart(HeldPart(hold.nbytes, list(hold.views or ())), Source.HELD)
        if self._ctx.service is not None:
            self._ctx.service.count(held_loads=1)
        return read
