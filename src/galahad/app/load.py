"""Loading one rank's part of a committed entry, and the refusal policy.

A part is read straight into its destination and verified there before anything is returned.
Any failure is a miss for this part, counted by reason (`MissReason`); a part that is damaged,
foreign or malformed, or that the medium could not read (EIO), also quarantines its entry for
every rank, while a failure that is not the part's (an injected fault, a key this process does
not hold, a newer format, a closed store) leaves it for the next request.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from galahad.domain.chain import ChainKey
from galahad.domain.counter import MissReason
from galahad.domain.error import (
    ForeignBlock,
    FormatError,
    HelperLost,
    IntegrityError,
    NewerFormat,
    StoreUnavailable,
    UnknownKey,
)
from galahad.domain.rank import RankLayout
from galahad.format import codec
from galahad.format.codec import CipherLookup, Expect, OpenedPart
from galahad.ports.helpers import PartHelpers
from galahad.ports.store import BlockStore, PartReader, ShareableReader
from galahad.app.segment import SegmentSpec, header_segments
from galahad.app.tally import Tally

__all__ = ["LoadedPart", "PartLoader"]

log = logging.getLogger(__name__)

LoadedPart = OpenedPart
"""A verified part: its header and plaintext payload (`segment_views()` cuts it per segment)."""


class PartLoader:
    """Loads of one namespace's parts from `store`, verified against `digest` and `layout`.

    `quarantine(key, reason)` sets an entry aside (the service's, which also forgets what it
    knew of it); `forget(key)` drops what was read of an entry's header (a key this process
    does not hold: the next lookup reads it again and does not offer the entry)."""

    def __init__(self, *, store: BlockStore, layout: RankLayout, digest: bytes, ciphers: CipherLookup, tally: Tally,
                 quarantine: Callable[[ChainKey, str], None], forget: Callable[[ChainKey], None]) -> None:
        self.store = store
        self._layout = layout
        self._digest = digest
        self._ciphers = ciphers
        self._tally = tally
        self._quarantine = quarantine
        self._forget = forget
        self._miss = threading.local()  # why this thread's last `load` missed (`last_miss`)

    def load(self, key: ChainKey, rank: int, *, out: memoryview | None, fail: bool,
             progress: Callable[[int], None] | None, pool: Executor | None, readers: PartHelpers | None,
             region_offset: int | None, segments: Sequence[SegmentSpec] | None,
             max_bytes: int | None) -> LoadedPart | None:
        """`KVCacheService.load_part` (its arguments are described there): `fail` is the fault
        already drawn, `pool` the frame pool (None: every frame in the calling thread), `readers`
        the helper processes attached, if any."""
        part = self._layout.part_of(rank)
        t0 = time.perf_counter()
        self._miss.reason = ""
        try:
            want = None if segments is None else header_segments(tuple(segments))
        except (FormatError, ValueError) as exc:  # the caller's table, not the part: nothing set aside
            self._tally.warn_once("load-segments", "[galahad] a load was given a segment table no part can hold: "
                                  "%s", exc)
            self.refuse(key, MissReason.ERROR, quarantine=False)
            return None
        try:
            if fail:
                # A test-only fault: a miss like a damaged block, but the entry is kept.
                self.refuse(key, MissReason.INJECTED, quarantine=False)
                return None
            reader = self.store.open_reader(key, part)
            if reader is None:
                self.refuse(key, MissReason.MISSING, quarantine=True)
                return None
            with reader:
                size = reader.size
                expect = Expect(namespace=self._digest, chain_key=key.raw, rank=part, world=self._layout.world_size,
                                segments=want, payload_max=_least(None if out is None else out.nbytes, max_bytes))
                opened = (None if progress is not None or readers is None
                          else _elsewhere(readers, reader, expect, out, region_offset, self._tally))
                if opened is None:
                    opened = codec.open_part_from(reader, expect=expect, ciphers=self._ciphers, pool=pool, out=out,
                                                  progress=progress)
        except StoreUnavailable as exc:
            self._tally.warn_once("load", "[galahad] load failed (store): %s", exc)
            # The medium could not read this part (EIO): set the entry aside as a damaged one, so
            # no rank offers it again. A failure that is not this part's (the store closed, too
            # many open files, no memory) leaves the entry for the next request.
            self.refuse(key, MissReason.IO, quarantine=exc.errno == errno.EIO)
            return None
        except UnknownKey:
            self.refuse(key, MissReason.KEY, quarantine=False)
            self._forget(key)  # the next lookup reads its header: not offered again
            return None
        except ForeignBlock:
            self.refuse(key, MissReason.NAMESPACE, quarantine=True)
            return None
        except IntegrityError:
            self.refuse(key, MissReason.DAMAGED, quarantine=True)
            return None
        except NewerFormat:  # a newer server sharing the store reads it: kept
            self.refuse(key, MissReason.FORMAT, quarantine=False)
            return None
        except FormatError:
            self.refuse(key, MissReason.FORMAT, quarantine=True)
            return None
        except MemoryError:  # what a part's header claims could not be had: that part's fault
            self._tally.warn_once("load-memory", "[galahad] a part asked for more memory than this process could "
                                  "get; refused and set aside as a malformed part")
            self.refuse(key, MissReason.FORMAT, quarantine=True)
            return None
        self._tally.add(bytes_loaded=size, load_seconds=time.perf_counter() - t0)
        return opened

    def refuse(self, key: ChainKey, reason: str, *, quarantine: bool) -> None:
        """A miss of `key` for `reason`: remembered for `last_miss`, counted, and with
        `quarantine` the entry set aside."""
        log.debug("[galahad] entry %s refused: %s", key.hex[:16], reason)
        self._miss.reason = reason
        self._tally.refused(reason)
        if quarantine:
            self._quarantine(key, reason)

    def last_miss(self) -> str:
        """Why the last `load` of the calling thread returned None (a `MissReason`; "" if it did
        not miss)."""
        return str(getattr(self._miss, "reason", ""))


def _elsewhere(readers: PartHelpers, reader: PartReader, expect: Expect, out: memoryview | None,
               region_offset: int | None, tally: Tally) -> OpenedPart | None:
    """The part read by a helper process, or None: read it here (no destination in the helpers'
    region, no shareable descriptor, or the helpers just stopped: `HelperLost` was logged once)."""
    if out is None or region_offset is None or not readers.running:
        return None
    fd = reader.shareable_fd() if isinstance(reader, ShareableReader) else None
    if fd is None:
        return None
    try:
        return readers.open_part(fd, reader.size, region_offset, out, expect)
    except HelperLost:
        return None
    except RuntimeError as exc:  # the helper failed, not the part (no Galahad error): read it here
        tally.warn_once("load-helper", "[galahad] a reader process could not read a part (%s); reading it "
                        "in this process", exc)
        return None


def _least(a: int | None, b: int | None) -> int | None:
    """The smaller of two bounds, either of which may be absent."""
    return b if a is None else a if b is None else min(a, b)
