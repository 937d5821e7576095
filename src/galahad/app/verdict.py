"""Whether this process can open a committed entry, asked of its header once and remembered.

An entry a lookup offers but this process cannot open (checksum-only where a key is set, or
sealed under a key not held: another server's, on the same folder) would be hit on every request
for a load that then fails (`refused_key`), so a lookup asks first. What this process does with a
committed entry (`Verdicts.verdict`): open it (`OPENS`); keep it unopened (`KEEP`: sealed under a
key it does not hold, which may come back, or by a newer format); or set it aside when its prompt
is saved again (`REPLACE`: sealed under a key retired on purpose, or plain where a key is set).
"""

from __future__ import annotations

import collections
import threading

from galahad.domain.chain import ChainKey
from galahad.format import codec
from galahad.format.codec import CipherLookup
from galahad.format.v1 import CipherId
from galahad.ports.store import BlockStore
from galahad.app.tally import Tally

__all__ = ["KEEP", "OPENS", "REPLACE", "Verdicts"]

OPENS, KEEP, REPLACE = 0, 1, 2
_OPENABLE_KEPT = 1 << 16  # entries whose verdict is remembered (the oldest are read again)
_UNOPENABLE = ("[galahad] the store holds entries this server cannot open (%s): they are misses, never "
               "errors. Entries sealed under a key this server does not hold are kept as they are (the key "
               "may come back: put it back as a retired line of the key file to read them); those under a "
               "key retired on purpose (by a key this server holds, or by hand: %s lists them; add the id "
               "of a key lost for good there) and those written without encryption while a key is set are set "
               "aside and written anew under the key in use when their prompt is saved again "
               "(docs/security.md, Rotation)")


class Verdicts:
    """The verdicts on committed entries of `store`, by key (thread-safe).

    `sealed`: this process saves encrypted. `retired_keys`: ids of keys retired on purpose, by a
    key this process holds or by hand (`adapters/crypto/retired.py`), which `retired_record`
    names in messages: an entry sealed under one is written anew when its prompt is saved again.
    """

    def __init__(self, *, store: BlockStore, ciphers: CipherLookup, sealed: bool, retired_keys: frozenset[bytes],
                 retired_record: str, tally: Tally) -> None:
        self.store = store
        self._ciphers = ciphers
        self._sealed = sealed
        self._retired_keys = retired_keys
        self._retired_record = retired_record
        self._tally = tally
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def opens(self, key: ChainKey) -> bool:
        """Whether this process can open the committed entry `key`: its part 0's header names a
        cipher and key it holds."""
        return self.verdict(key) == OPENS

    def verdict(self, key: ChainKey) -> int:
        """`OPENS`, `KEEP` or `REPLACE` for the committed entry `key`. Read once per entry, then
        remembered; a header that does not read is left to the load to refuse, count and
        quarantine (`OPENS`). A commit or a quarantine by this process forgets what was read
        (`forget`: new files may take the entry's name)."""
        known = self._known.get(key.raw)
        if known is None:
            reader = self.store.open_reader(key, 0)
            if reader is None:
                return OPENS  # gone meanwhile: the load will say so
            with reader:
                named = codec.header_key(reader)
            known = OPENS if named is None or self._ciphers(*named) is not None else self._unopenable(*named)
            self._remember(key, known)
            if named is not None and named[0] == codec.NEWER_FORMAT:
                self._tally.warn_once("newer", "[galahad] the store holds entries of a newer Galahad format (a "
                                      "newer server shares this store): they are misses here, and kept for the "
                                      "servers that read them")
            elif known != OPENS and named is not None:
                what = ("written without encryption while a key is set" if named[0] == CipherId.XXH3
                        else f"for example sealed under key id {named[1].hex()}")
                self._tally.warn_once("unopenable", _UNOPENABLE, what, self._retired_record)
        return known

    def forget(self, key: ChainKey) -> None:
        """Read `key`'s header again the next time it is asked about."""
        with self._lock:
            self._known.pop(key.raw, None)

    def _unopenable(self, cipher_id: int, key_id: bytes) -> int:
        if cipher_id == codec.NEWER_FORMAT:
            return KEEP
        if cipher_id == CipherId.XXH3:
            return REPLACE if self._sealed else KEEP  # plain under a key: it could be forged
        return REPLACE if key_id in self._retired_keys else KEEP

    def _remember(self, key: ChainKey, verdict: int) -> None:
        with self._lock:
            self._known[key.raw] = verdict
            self._known.move_to_end(key.raw)
            while len(self._known) > _OPENABLE_KEPT:
                self._known.popitem(last=False)
