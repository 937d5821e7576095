"""The composition root: from the parsed settings, the licence check, the keys and the store.

The settings come parsed from `galahad.config`, the one place `GALAHAD_*` is read.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from galahad.config import Settings
from galahad.domain.chunking import Chunking
from galahad.domain.error import (
    ConfigError,
    GalahadError,
    KeyRefused,
    LicenceRefused,
    StoreUnavailable,
)
from galahad.domain.namespace import Namespace
from galahad.domain.rank import RankLayout
from galahad.format.codec import CipherLookup, cipher_lookup
from galahad.format.fanout import usable_cores
from galahad.adapters.posix import readhash
from galahad.adapters.posix.memory import kernel_zeroed
from galahad.ports.cipher import Cipher
from galahad.ports.store import BlockStore
from galahad.ports.helpers import HelperRecipe
from galahad.app.service import KVCacheService, OtherLayout

__all__ = ["CacheHandle", "open_cache"]

if TYPE_CHECKING:
    from galahad.adapters.crypto.aesgcm import AesGcmCiphers
    from galahad.adapters.crypto.key import Keyring
    from galahad.adapters.licence import LicenceWatch

log = logging.getLogger(__name__)

SAVE_YIELD_S = 0.4  # each save waits at most this long while a load of its worker runs (`galahad.app.priority`):
# loads are on a request's path, saves are not (docs/benchmarks.md, GPU: the multi-turn rounds)


_READER_CORES = 8  # reader processes start from this many usable cores per worker on
_READER_CORES_MORE = 16  # and three per four cores (up to 12) from this many on


def reader_processes_for(cores: int, ranks: int = 1) -> int:
    """How many reader processes a vLLM worker on a GPU starts: one per two of its share of the
    usable cores (`ranks`: the workers of the model, each starting its own) up to 8 once that
    share is 8, three per four up to 12 once it is 16, none below 8. Below 8 cores the engine's
    own threads read as fast and helpers would only compete with them; on 16 cores 12 helpers
    read a multi-turn workload's loads faster than 8 (docs/benchmarks.md, GPU)."""
    share = cores // max(1, ranks)
    if share >= _READER_CORES_MORE:
        return min(12, share * 3 // 4)
    return min(8, share // 2) if share >= _READER_CORES else 0


def writer_processes_for(cores: int, ranks: int = 1) -> int:
    """How many writer processes a vLLM worker on a GPU starts to seal and write its saves: two
    once its share of the usable cores is 8, four once it is 16, none below 8 (the engine's own
    save threads then). Saves run beside serving: a writer seals a 64-token part of an 8B
    model (9 MiB) in about a millisecond, so four keep up with any disk while leaving the cores
    to the engine and the reader processes."""
    share = cores // max(1, ranks)
    if share >= _READER_CORES_MORE:
        return 4
    return 2 if share >= _READER_CORES else 0


@attrs.frozen
class CacheHandle:
    """What `open_cache` gives an engine adapter: a service, or None and the reason to log.

    With a service comes `licence`, the watch that checks the licence again while the server
    runs: the adapter `start`s it with the function that stops its caching, and `close`s it at
    shutdown."""

    service: KVCacheService | None
    reason: str = ""
    licence: LicenceWatch | None = None

    @property
    def enabled(self) -> bool:
        return self.service is not None


def _cipher_setup(settings: Settings) -> tuple[Cipher, CipherLookup, str, HelperRecipe, Keyring | None]:
    """The sealing cipher, the lookup of ciphers by header, a line describing encryption, how a
    reader process builds the same lookup, and the keyring (None: no encryption)."""
    from galahad.adapters.crypto.aesgcm import AesGcmCiphers
    from galahad.adapters.crypto.key import load_keyring
    from galahad.format.checksum import Xxh3FrameCheck

    keyring = load_keyring(key_file=settings.key_file, key_command=settings.key_command)
    if keyring is None:
        check = Xxh3FrameCheck()
        line = ("encryption OFF: no GALAHAD_KEY_FILE or GALAHAD_KEY_COMMAND; frames carry "
                "xxh3-128 checksums (detects damage, not forgery)")
        return check, cipher_lookup(check), line, HelperRecipe(__name__, "helper_ciphers", (None,)), None
    ciphers = AesGcmCiphers(keyring, parallel_open=parallel_open())
    source = f"GALAHAD_KEY_FILE={settings.key_file}" if settings.key_file else "GALAHAD_KEY_COMMAND"
    retired = f", {len(keyring.retired)} retired key(s) for reading" if keyring.retired else ""
    line = f"encryption ON: AES-256-GCM, key id {keyring.current().key_id.hex()} from {source}{retired}"
    recipe = HelperRecipe(__name__, "helper_ciphers", (keyring,))
    return ciphers.for_sealing(), _sealed_only(ciphers), line, recipe, keyring


def _retired_keys(settings: Settings, keyring: Keyring | None) -> tuple[frozenset[bytes], str]:
    """The ids of keys retired on purpose, this keyring's retired lines noted first, and the
    record's path (`adapters/crypto/retired.py`): entries sealed under them are written anew
    when saved again."""
    from galahad.adapters.crypto.retired import RECORD_NAME, note_retired_keys

    current, retired = (None, ()) if keyring is None else (
        keyring.current().key_id, tuple(key.key_id for key in keyring.retired))
    return note_retired_keys(settings.cache_dir, current, retired), os.path.join(settings.cache_dir, RECORD_NAME)


def _sealed_only(ciphers: AesGcmCiphers) -> CipherLookup:
    """The lookup with a key configured: only sealed files are accepted (a plain file could be forged)."""
    from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID

    def sealed(cipher_id: int, key_id: bytes) -> Cipher | None:
        return ciphers.for_key_id(key_id) if cipher_id == AES_GCM_CIPHER_ID else None

    return sealed


def _warn_relative(settings: Settings, who: str) -> None:
    """One warning per path setting given relative: a restart from another working folder (a unit
    file's, a container's) would look elsewhere, and find no store, key or licence there."""
    resolved = {"GALAHAD_CACHE_DIR": settings.cache_dir, "GALAHAD_KEY_FILE": settings.key_file,
                "GALAHAD_LICENCE_FILE": settings.licence_file,
                "GALAHAD_LICENCE_ISSUER_KEY": settings.licence_issuer_key}
    for name, raw in settings.relative_paths:
        log.warning("[galahad]%s %s=%r is a relative path, taken as %s from the folder this server "
                    "started in; a restart from another folder would not find it: set %s to the "
                    "absolute path", who, name, raw, resolved[name], name)


def _warn_unknown(settings: Settings, who: str) -> None:
    """One warning per GALAHAD_* variable that is not a setting (a typo, or a setting of another
    version): it changes nothing, and the operator should know that; a test hook that cannot be
    read, one warning, and it stays off."""
    for name in settings.unknown:
        log.warning("[galahad]%s %s is not a Galahad setting and is ignored; the settings are listed "
                    "in docs/configuration.md", who, name)
    for problem in settings.test.problems:
        log.warning("[galahad]%s test hook: %s", who, problem)


def helper_ciphers(keyring: Keyring | None) -> CipherLookup:
    """The `CipherLookup` a reader process (`galahad.adapters.helpers.pool`) uses: the one `_cipher_setup`
    builds for the same keyring, with OpenSSL (a helper reads one part at a time)."""
    from galahad.adapters.crypto.aesgcm import AesGcmCiphers
    from galahad.format.checksum import Xxh3FrameCheck

    return cipher_lookup(Xxh3FrameCheck()) if keyring is None else _sealed_only(AesGcmCiphers(keyring))


def open_cache(
    settings: Settings,
    namespace: Namespace,
    layout: RankLayout,
    *,
    role: str = "",
    detail: str | None = None,
    lookups: bool = False,
    clock: Callable[[], dt.datetime] | None = None,
) -> CacheHandle:
    """Check the licence, open the store and the keys, and log the `[galahad]` startup lines.

    The licence must cover `layout.gpu_ranks` points (tensor x pipeline x data parallel: every
    GPU rank of the deployment); `clock` is the time it is judged at (default: now, UTC; tests
    move it), at startup and by the watch the handle carries.

    `detail` replaces the engine-specific part of the `caching ENABLED (...)` line. `lookups`:
    this process looks entries up (vLLM's scheduler side): it also says whether the namespace is
    new and which other TP x PP layouts of the model the store holds (their misses are counted).
    Never raises for a runtime condition: a refused licence, an unusable key or store gives a
    handle without a service and the reason (logged once as `NOT CACHING: <reason>`). A
    malformed setting is refused earlier, by `read_settings`.
    """
    who = f" ({role})" if role else ""
    _warn_relative(settings, who)
    _warn_unknown(settings, who)
    try:
        chunking = Chunking(settings.payload_order, namespace.block_size, settings.min_tokens)
    except ConfigError as exc:
        return _not_caching(str(exc), who)
    from galahad.adapters.licence import EdLicence, LicenceWatch

    licence = EdLicence(settings.licence_file, settings.licence_issuer_key)
    status = licence.check(layout.gpu_ranks, now=clock() if clock is not None else None)
    if not status.valid:  # one line: the NOT CACHING warning carries the refusal
        return _not_caching(status.describe(), who)
    log.info("[galahad]%s %s", who, status.describe())
    try:
        cipher, ciphers, crypto_line, recipe, keyring = _cipher_setup(settings)
        store = _open_store(settings, namespace)
        retired, record = _retired_keys(settings, keyring)
    except (KeyRefused, StoreUnavailable, ConfigError, LicenceRefused) as exc:
        return _not_caching(_message(exc), who)
    except GalahadError as exc:
        return _not_caching(f"{type(exc).__name__}: {exc}", who)
    log.info("[galahad]%s store %s", who, settings.cache_dir)
    log.info("[galahad]%s namespace %s (model %s, %s, block %d, %s, order %s)", who,
             namespace.hex[:16], namespace.model, namespace.dtype, namespace.block_size,
             layout.describe(), namespace.payload_order.value)
    log.info("[galahad]%s %s", who, crypto_line)
    if not readhash.available():
        log.info("[galahad]%s plain loads verify in Python: the compiled read-and-verify loop "
                 "(galahad.adapters.posix._readhash) was not built at install (no C compiler then); loads are "
                 "correct but slower where many run at once. To build it, reinstall Galahad where "
                 "gcc and the Python headers are present.", who)
    others = _other_layouts(store, namespace, layout, who) if lookups else ()
    if settings.test.fault_load_rate:
        log.warning("[galahad]%s TEST FAULT INJECTION ON: GALAHAD_FAULT_LOAD_RATE=%s of loads fail "
                    "on purpose. Never set this in production.", who, settings.test.fault_load_rate)
    service = KVCacheService(
        namespace=namespace,
        store=store,
        chunking=chunking,
        layout=layout,
        cipher=cipher,
        ciphers=ciphers,
        retired_keys=retired,
        retired_record=record,
        frame_threads=usable_cores(),  # a load's frames fan out over them
        fault_load_rate=settings.test.fault_load_rate,
        other_layouts=others,
        helper_recipe=recipe,
        reader_processes=reader_processes_for(usable_cores(), layout.world_size),
        writer_processes=writer_processes_for(usable_cores(), layout.world_size),
        save_yield_s=SAVE_YIELD_S,
        allocate_sealed=kernel_zeroed,
    )
    if detail is None:
        detail = (f"min {settings.min_tokens} tokens, order {settings.payload_order.value}, "
                  f"async load {'on' if settings.async_load else 'off'}, load policy {settings.load_policy}")
    log.info("[galahad]%s caching ENABLED (%s)", who, detail)
    return CacheHandle(service, licence=LicenceWatch(licence, layout.gpu_ranks, status, who=who, clock=clock))


def _message(exc: Exception) -> str:
    """What an error says, without the `[Errno N]` that `str()` puts before an OSError's message."""
    return str(exc.strerror) if isinstance(exc, OSError) and exc.strerror else str(exc)


# from here on pycryptodome's lock-free opening beats OpenSSL's, where OpenSSL holds the
# interpreter lock (cryptography before 50): measured on a 16-core GPU host
_PARALLEL_OPEN_CORES = 12


def parallel_open(cores: int | None = None, openssl_outside_lock: bool | None = None) -> bool:
    """Whether sealed frames are opened with pycryptodome (`AesGcmCipher.parallel_open`): only
    where OpenSSL holds the interpreter lock (cryptography before 50) and the cores are many
    enough for pycryptodome's 1-1.9 GB/s per core, side by side, to beat one OpenSSL at a time."""
    from galahad.adapters.crypto.aesgcm import OPENSSL_OUTSIDE_LOCK

    cores = usable_cores() if cores is None else cores
    outside = OPENSSL_OUTSIDE_LOCK if openssl_outside_lock is None else openssl_outside_lock
    return not outside and cores >= _PARALLEL_OPEN_CORES


def _other_layouts(store: BlockStore, namespace: Namespace, layout: RankLayout,
                   who: str) -> tuple[OtherLayout, ...]:
    """Say at startup whether this namespace is new and which other TP x PP layouts of the same
    model the store holds (read once, here); their probes count namespace misses later."""
    from galahad.adapters.fs.store import FilesystemBlockStore

    if not isinstance(store, FilesystemBlockStore):
        return ()
    try:
        found = store.other_layouts()
    except StoreUnavailable as exc:
        log.warning("[galahad]%s cannot list the store's other namespaces: %s", who, exc)
        return ()
    others = tuple(
        OtherLayout(bytes.fromhex(digest), int(info.get("tp_size", 0)), int(info.get("pp_size", 0)),
                    functools.partial(store.committed_in, digest))
        for digest, info in found
    )
    held = "; ".join(o.describe() for o in others)
    if store.fresh:
        log.info("[galahad]%s namespace %s is new in this store (%s): nothing saved under it yet%s",
                 who, namespace.hex[:16], layout.describe(),
                 f"; the store holds this model under other layouts, never read by this one: {held}"
                 if others else "")
    elif others:
        log.info("[galahad]%s the store also holds this model under other layouts, never read by "
                 "this one: %s", who, held)
    if others:
        log.info("[galahad]%s lookups that miss here but would hit under another layout are "
                 "counted as namespace_misses", who)
    return others


def _open_store(settings: Settings, namespace: Namespace) -> BlockStore:
    from galahad.adapters.posix.private_folder import make_private_folders
    from galahad.adapters.fs.store import FilesystemBlockStore

    if os.path.lexists(settings.cache_dir) and not os.path.isdir(settings.cache_dir):
        raise StoreUnavailable(
            f"GALAHAD_CACHE_DIR={settings.cache_dir} is a file, not a folder; point GALAHAD_CACHE_DIR "
            "at a folder (it is created, mode 0700, when absent)"
        )
    try:
        make_private_folders(settings.cache_dir)  # it and any missing parents, 0700
    except OSError as exc:
        raise StoreUnavailable(
            f"cannot create the store folder GALAHAD_CACHE_DIR={settings.cache_dir}: "
            f"{exc.strerror or exc}; create it (mode 0700) or point GALAHAD_CACHE_DIR elsewhere"
        ) from exc
    return FilesystemBlockStore(settings.cache_dir, namespace, max_bytes=settings.max_bytes)


def _not_caching(reason: str, who: str) -> CacheHandle:
    log.warning("[galahad]%s NOT CACHING: %s", who, reason)
    return CacheHandle(None, reason)
