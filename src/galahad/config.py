"""Galahad's settings: every `GALAHAD_*` variable, read from the environment in one place.

The servers (vLLM's connector, SGLang's backend), `galahad-format` and `galahad-licence` read
them here, with the same rules and the same messages; docs/configuration.md lists them. A
malformed value raises `ConfigError` naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import attrs

from galahad.domain.chunking import DEFAULT_MIN_TOKENS
from galahad.domain.error import ConfigError
from galahad.domain.namespace import PayloadOrder

__all__ = ["SETTINGS", "TEST_HOOKS", "Settings", "TestHooks", "default_cache_dir", "issuer_key_of",
           "key_source", "parse_size", "read_settings"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(?:i?b)?|b?)\s*$", re.IGNORECASE)  # 5i, 5ib: no
_MAX_SIZE = float(1 << 63)  # bytes: past any disk, and past what the store's counts hold
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
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


def issuer_key_of(environ: Mapping[str, str] | None = None) -> str | None:
    """GALAHAD_LICENCE_ISSUER_KEY as the servers read it (None: unset)."""
    return _path(os.environ if environ is None else environ, "GALAHAD_LICENCE_ISSUER_KEY")
