"""The composition root: reads the environment once, builds the config, picks the adapters.

Every `GALAHAD_*` setting is read here and nowhere else (docs/configuration.md lists them).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

from galahad.domain.chunking import DEFAULT_MIN_TOKENS, Chunking
from galahad.domain.error import (
    ConfigError,
    GalahadError,
    KeyRefused,
    LicenceRefused,
    StoreUnavailable,
)
from galahad.domain.namespace import Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.codec import CipherLookup, cipher_lookup
from galahad.fanout import usable_cores
from galahad import readhash
from galahad.ports.cipher import Cipher
from galahad.ports.store import BlockStore
from galahad.reader_pool import HelperRecipe
from galahad.service import KVCacheService, OtherLayout

__all__ = ["CacheHandle", "Settings", "TestHooks", "open_cache", "read_settings"]

if TYPE_CHECKING:
    from galahad.adapters.crypto.aesgcm import AesGcmCiphers
    from galahad.adapters.crypto.key import Keyring
    from galahad.adapters.licence import LicenceWatch

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(?:i?b)?|b?)\s*$", re.IGNORECASE)  # 5i, 5ib: no
_MAX_SIZE = float(1 << 63)  # bytes: past any disk, and past what the store's counts hold
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
SAVE_YIELD_S = 0.4  # each save waits at most this long while a load of its worker runs (`galahad.priority`):
# loads are on a request's path, saves are not (docs/benchmarks.md, GPU: the multi-turn rounds)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """`$XDG_CACHE_HOME/galahad/store`, else `~/.cache/galahad/store`, from `environ` (the
    process's environment by default). A relative XDG_CACHE_HOME is ignored, as the XDG spec says."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(_home(env), ".cache")
    return os.path.join(base, "galahad", "store")


def _home(env: Mapping[str, str]) -> str:
    return env.get("HOME") or os.path.expanduser("~")


@attrs.frozen
class TestHooks:
    """The test-only settings (docs/configuration.md, "Testing"), read with the others and handed
    to what needs them; all off in production. A value a hook cannot read leaves it off, with a
    warning (`problems`, logged by whoever opens the cache), rather than stopping the server;
    a malformed fault rate is refused, as a setting is."""

    __test__ = False  # not a pytest class

    fault_load_rate: float = 0.0  # GALAHAD_FAULT_LOAD_RATE: this share of loads fail on purpose
    perturb_load: str = ""  # GALAHAD_TEST_PERTURB_LOAD: "", "all", or a group kind ("full", "sliding", "state")
    counters_file: str | None = None  # GALAHAD_TEST_COUNTERS_FILE
    save_delay: tuple[int, float, str | None] | None = None  # GALAHAD_TEST_SAVE_DELAY: rank, seconds, gate
    problems: tuple[str, ...] = ()


@attrs.frozen
class Settings:
    """Every Galahad setting, parsed and validated. Built once by `read_settings`."""

    cache_dir: str
    key_file: str | None = None
    key_command: str | None = None
    licence_file: str | None = None
    licence_issuer_key: str | None = None
    min_tokens: int = DEFAULT_MIN_TOKENS
    payload_order: PayloadOrder = PayloadOrder.LAYER
    async_load: bool = True
    max_bytes: int | None = None
    load_policy: str = "auto"
    preload_bytes: int | None = None  # read ahead at startup; None: auto (the CUDA path's pinned arena)
    relative_paths: tuple[tuple[str, str], ...] = ()  # (setting, value) of paths given relative: warned of
    unknown: tuple[str, ...] = ()  # GALAHAD_* variables that are not settings: warned of
    test: TestHooks = attrs.field(factory=TestHooks)


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in allowed:
        raise ConfigError(f"{name}={raw!r} is not accepted; use one of: {', '.join(allowed)}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not accepted; use one of: 1, 0, true, false, on, off, yes, no")


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int,
         maximum: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    accepted = f"a whole number >= {minimum}" if maximum is None else f"a whole number from {minimum} to {maximum}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not accepted; use {accepted}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(f"{name}={raw!r} is not accepted; use {accepted}")
    return value


def key_source(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """GALAHAD_KEY_FILE and GALAHAD_KEY_COMMAND: at most one of them. One that is set but blank is
    refused rather than read as unset: it would turn encryption off without a word (a secret left
    out of a unit file's template looks just like that)."""
    for name in ("GALAHAD_KEY_FILE", "GALAHAD_KEY_COMMAND"):
        raw = env.get(name)
        if raw is not None and raw.strip() == "":
            raise ConfigError(
                f"{name} is set but empty, which would store without encryption; give the key "
                f"{'file' if name.endswith('FILE') else 'command'}, or unset {name} to store without encryption"
            )
    key_file, key_command = _path(env, "GALAHAD_KEY_FILE"), (env.get("GALAHAD_KEY_COMMAND") or "").strip() or None
    if key_file and key_command:
        raise ConfigError(
            "GALAHAD_KEY_FILE and GALAHAD_KEY_COMMAND are both set; set one (the key file, or the "
            "command that prints the key)"
        )
    return key_file, key_command


def parse_size(raw: str, name: str = "GALAHAD_MAX_BYTES") -> int:
    """Bytes from `123`, `500M`, `80GiB`, `1.5T` (binary units). Refuses anything else."""
    match = _SIZE.match(raw)
    if not match:
        raise ConfigError(
            f"{name}={raw!r} is not accepted; use a byte count such as 500000000, 500M, 80G or 2TiB"
        )
    scaled = float(match.group(1)) * _SCALE[(match.group(2) or "").lower()]
    if not scaled < _MAX_SIZE:  # also infinity, from hundreds of digits
        raise ConfigError(f"{name}={raw!r} is not accepted; it is larger than any disk (at most 8 EiB)")
    value = int(scaled)
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} is not accepted; the size must be positive")
    return value


_PATH_SETTINGS = ("GALAHAD_CACHE_DIR", "GALAHAD_KEY_FILE", "GALAHAD_LICENCE_FILE", "GALAHAD_LICENCE_ISSUER_KEY")


def _path(env: Mapping[str, str], name: str) -> str | None:
    """The absolute path a path setting names (`~` is the home folder; a relative path is taken
    from the working folder now, once: see `Settings.relative_paths`)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    path = raw.strip()
    if path == "~" or path.startswith("~/"):
        path = _home(env) + path[1:]
    return os.path.abspath(os.path.expanduser(path))


def _relative_paths(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    found = ((name, (env.get(name) or "").strip()) for name in _PATH_SETTINGS)
    return tuple((name, raw) for name, raw in found if raw and not raw.startswith(("/", "~")))


SETTINGS = (
    "GALAHAD_CACHE_DIR", "GALAHAD_KEY_FILE", "GALAHAD_KEY_COMMAND", "GALAHAD_LICENCE_FILE",
    "GALAHAD_LICENCE_ISSUER_KEY", "GALAHAD_MAX_BYTES", "GALAHAD_MIN_TOKENS", "GALAHAD_PAYLOAD_ORDER",
    "GALAHAD_LOAD_POLICY", "GALAHAD_ASYNC_LOAD", "GALAHAD_PRELOAD_BYTES",
)
TEST_HOOKS = ("GALAHAD_FAULT_LOAD_RATE", "GALAHAD_TEST_PERTURB_LOAD", "GALAHAD_TEST_COUNTERS_FILE",
              "GALAHAD_TEST_SAVE_DELAY", "GALAHAD_TEST_MODEL_CACHE")


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse `GALAHAD_*` from the environment; a bad value raises `ConfigError` naming it."""
    env = os.environ if environ is None else environ
    order_raw = env.get("GALAHAD_PAYLOAD_ORDER", "").strip()
    order = PayloadOrder.parse(order_raw) if order_raw else PayloadOrder.LAYER
    max_raw = env.get("GALAHAD_MAX_BYTES", "").strip()
    min_tokens = _int(env, "GALAHAD_MIN_TOKENS", DEFAULT_MIN_TOKENS, 0)
    key_file, key_command = key_source(env)
    return Settings(
        cache_dir=_path(env, "GALAHAD_CACHE_DIR") or default_cache_dir(env),
        key_file=key_file,
        key_command=key_command,
        licence_file=_path(env, "GALAHAD_LICENCE_FILE"),
        licence_issuer_key=_path(env, "GALAHAD_LICENCE_ISSUER_KEY"),
        min_tokens=DEFAULT_MIN_TOKENS if min_tokens is None else min_tokens,
        payload_order=order,
        async_load=_bool(env, "GALAHAD_ASYNC_LOAD", True),
        max_bytes=parse_size(max_raw) if max_raw else None,
        load_policy=_choice(env, "GALAHAD_LOAD_POLICY", "auto", ("auto", "always")),
        preload_bytes=_preload_bytes(env),
        relative_paths=_relative_paths(env),
        unknown=tuple(sorted(name for name in env if name.startswith("GALAHAD_")
                             and name not in SETTINGS and name not in TEST_HOOKS)),
        test=_test_hooks(env),
    )


def _test_hooks(env: Mapping[str, str]) -> TestHooks:
    """The test hooks. One that cannot be read stays off and says why, except the fault rate,
    refused as a setting is (a fault test that ran without its faults would pass for nothing)."""
    problems: list[str] = []
    fault_raw = env.get("GALAHAD_FAULT_LOAD_RATE", "").strip()
    try:
        fault = float(fault_raw) if fault_raw else 0.0
    except ValueError:
        fault = -1.0
    if not 0.0 <= fault <= 1.0:  # refused like a setting: a fault test must not run without its faults
        raise ConfigError(f"GALAHAD_FAULT_LOAD_RATE={fault_raw!r} is not accepted; use a share between 0 and 1")
    raw = env.get("GALAHAD_TEST_PERTURB_LOAD", "").strip().lower()
    perturb = "all" if raw in _TRUE else raw if raw in ("full", "sliding", "state") else ""
    if raw and not perturb and raw not in _FALSE:
        problems.append(f"GALAHAD_TEST_PERTURB_LOAD={raw!r} is not accepted (use 1, full, sliding or state); "
                        "the test hook stays off")
    delay_raw = env.get("GALAHAD_TEST_SAVE_DELAY", "").strip()
    delay: tuple[int, float, str | None] | None = None
    if delay_raw:
        try:
            rank, seconds, *gate = delay_raw.split(":", 2)
            delay = int(rank), max(0.0, float(seconds)), (gate[0] if gate else None)
        except ValueError:
            problems.append(f"GALAHAD_TEST_SAVE_DELAY={delay_raw!r} is not accepted (use RANK:SECONDS[:GATE]); "
                            "the test hook stays off")
    return TestHooks(fault_load_rate=fault, perturb_load=perturb,
                     counters_file=env.get("GALAHAD_TEST_COUNTERS_FILE", "").strip() or None,
                     save_delay=delay, problems=tuple(problems))


def _preload_bytes(env: Mapping[str, str]) -> int | None:
    """GALAHAD_PRELOAD_BYTES: None for `auto` (or unset), 0 for `0`/`off`, else a size."""
    raw = (env.get("GALAHAD_PRELOAD_BYTES") or "").strip()
    if raw == "" or raw.lower() == "auto":
        return None
    if raw.lower() in ("0", "off"):
        return 0
    try:
        return parse_size(raw, "GALAHAD_PRELOAD_BYTES")
    except ConfigError:
        raise ConfigError(f"GALAHAD_PRELOAD_BYTES={raw!r} is not accepted; use auto, 0 (off) or a "
                          "byte count such as 4G or 500M") from None


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
    """The `CipherLookup` a reader process (`galahad.reader_pool`) uses: the one `_cipher_setup`
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
                 "(galahad._readhash) was not built at install (no C compiler then); loads are "
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
        save_yield_s=SAVE_YIELD_S,
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
    from galahad.private_folder import make_private_folders
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
