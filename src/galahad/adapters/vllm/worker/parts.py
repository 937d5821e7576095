"""What the worker's loads read and where each part came from.

A load reads each entry's part from one of three places (`loads.Loader.source`): the copy a
pending save still holds (`HeldPart`), what was read ahead at startup, or the store. A
`ReadPart` carries the part with what the worker must know to copy it in and give its memory
back: the pinned buffer it lies in, whether it was already copied in while it was read, and
where it came from (a load from memory says nothing about the store's read rate).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import torch

from galahad.adapters.cuda.pinned import PinnedBuffer
from galahad.adapters.cuda.transfer import CudaBlockTransfer, Gathered
from galahad.adapters.vllm.metadata import EntryRef
from galahad.app.service import LoadedPart as StoredPart

__all__ = ["Failure", "HeldBuffer", "HeldPart", "Hold", "LoadOutcome", "ReadPart", "SaveCopy", "Source"]


class Failure(enum.Enum):
    """Why an entry of a load job was not loaded; the job is cut there and vLLM recomputes the
    rest. The value is what the worker's report says (`GalahadWorkerMetadata.failed_keys`)."""

    DISABLED = "disabled"  # this worker has no store or no KV caches registered
    REFUSED = "refused"  # the store refused the part (missing, damaged, other key: counted there)
    SHAPE = "shape"  # the part does not fit this engine's blocks (quarantined)
    ERROR = "error"  # Galahad's own load path raised (logged with its traceback)
    BROKEN = "broken"  # the scheduler side could not plan the job


class Source(enum.Enum):
    STORE = "store"  # read from the disk and verified
    HELD = "held"  # the copy a save not yet durable holds (counted `held_loads`)
    PRELOADED = "preloaded"  # read ahead and verified at startup (counted `preloaded_loads`)


class SaveCopy:
    """A save's pinned buffer (one entry's, or a batch's), given back to the pool once every
    entry in it was written (or given up) and no load reads it any more. Loads that read it
    give it back in the order their copies were issued (all on the engine's thread, on the one
    load stream), so the last copy's event is the one the buffer's next user waits for."""

    def __init__(self, cuda: CudaBlockTransfer, gathered: Gathered, entries: int) -> None:
        self._cuda, self.gathered = cuda, gathered
        self._left, self._readers = entries, 0
        self._last: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def written(self) -> None:
        """One entry's save is over (its hold was dropped first)."""
        with self._lock:
            self._left -= 1
            free = self._left == 0 and self._readers == 0
        if free:
            self._free()

    def read(self) -> None:
        with self._lock:
            self._readers += 1

    def done_reading(self, ready: torch.cuda.Event | None) -> None:
        with self._lock:
            self._readers -= 1
            self._last = ready if ready is not None else self._last
            free = self._left == 0 and self._readers == 0
        if free:
            self._free()

    def _free(self) -> None:
        buf = self.gathered.buffer
        if buf is not None:
            self._cuda.pool.release(buf, self._last if self._last is not None else self.gathered.done)


@dataclass
class Hold:
    """An entry whose save is not durable yet, and the copy of its payload that save holds: on
    CUDA `host` (layer-major, in `copy`'s pinned buffer), on the byte path `views` (a layer each)."""

    nrows: int
    nbytes: int
    copy: SaveCopy | None = None
    host: torch.Tensor | None = None
    views: list[memoryview] | None = None


@dataclass
class HeldPart:
    """A part loaded from a pending save's copy (`Hold`): no header, nothing read or verified."""

    nbytes: int
    views: list[memoryview]

    def segment_views(self) -> list[memoryview]:
        return self.views


@dataclass
class HeldBuffer:
    """Where a `HeldPart` on the CUDA path is copied in from: the save's pinned buffer."""

    copy: SaveCopy
    host: torch.Tensor
    ready: torch.cuda.Event | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        return self.host[:nbytes]


@dataclass(eq=False)
class ReadPart:
    """One entry's part as a load read it. `buffer`: the pinned memory it lies in (CUDA path;
    None on the byte path, the bytes are then the part's own); `streamed`: already copied into
    its blocks layer by layer as it verified (`CudaBlockTransfer.stream_in`)."""

    part: StoredPart | HeldPart
    source: Source
    buffer: PinnedBuffer | HeldBuffer | None = None
    streamed: bool = False

    @property
    def nbytes(self) -> int:
        """The payload bytes."""
        part = self.part
        return part.nbytes if isinstance(part, HeldPart) else part.header.payload_len

    def segment_views(self) -> list[memoryview]:
        return self.part.segment_views()


class LoadOutcome:
    """The parts read for a job (a usable prefix of its entries) and the first failure, if any."""

    def __init__(self, parts: list[ReadPart], failed: EntryRef | None = None,
                 reason: Failure | None = None, seconds: float = 0.0) -> None:
        self.parts, self.failed, self.reason, self.seconds = parts, failed, reason, seconds
