"""Settings: every malformed value is refused with a message naming the variable, value and choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from galahad.config import TestHooks, parse_size, read_settings
from galahad.domain.error import ConfigError
from galahad.domain.namespace import PayloadOrder


def test_defaults_when_nothing_is_set() -> None:
    s = read_settings({"HOME": "/home/x"})
    assert s.payload_order is PayloadOrder.LAYER
    assert s.min_tokens == 256
    assert s.async_load is True
    assert s.max_bytes is None
    assert s.key_file is None
    assert s.test == TestHooks()  # every test hook off
    assert s.load_policy == "auto"
    assert s.preload_bytes is None  # auto: the CUDA path's pinned arena, nothing on the CPU
    assert s.unknown == ()
    assert s.cache_dir.endswith("galahad/store")


def test_every_setting_is_read() -> None:
    s = read_settings(
        {
            "GALAHAD_CACHE_DIR": "/srv/kv",
            "GALAHAD_KEY_FILE": "/srv/key",
            "GALAHAD_LICENCE_FILE": "/etc/l.lic",
            "GALAHAD_LICENCE_ISSUER_KEY": "/etc/issuer.pub",
            "GALAHAD_MIN_TOKENS": "64",
            "GALAHAD_PAYLOAD_ORDER": "chunk",
            "GALAHAD_ASYNC_LOAD": "off",
            "GALAHAD_MAX_BYTES": "2G",
            "GALAHAD_LOAD_POLICY": "Always",
            "GALAHAD_PRELOAD_BYTES": "4G",
            "GALAHAD_FAULT_LOAD_RATE": "0.33",
            "GALAHAD_TEST_PERTURB_LOAD": "sliding",
            "GALAHAD_TEST_COUNTERS_FILE": "/tmp/c.json",
            "GALAHAD_TEST_SAVE_DELAY": "1:2.5:/tmp/gate",
        }
    )
    assert (s.cache_dir, s.key_file, s.licence_file) == ("/srv/kv", "/srv/key", "/etc/l.lic")
    assert s.licence_issuer_key == "/etc/issuer.pub"
    assert s.min_tokens == 64 and s.payload_order is PayloadOrder.CHUNK
    assert s.async_load is False
    assert s.max_bytes == 2 << 30
    assert s.load_policy == "always"
    assert s.preload_bytes == 4 << 30
    assert s.test == TestHooks(fault_load_rate=0.33, perturb_load="sliding", counters_file="/tmp/c.json",
                               save_delay=(1, 2.5, "/tmp/gate"))
    assert s.unknown == ()
    assert read_settings({"GALAHAD_PRELOAD_BYTES": "0"}).preload_bytes == 0
    assert read_settings({"GALAHAD_PRELOAD_BYTES": "off"}).preload_bytes == 0
    assert read_settings({"GALAHAD_PRELOAD_BYTES": "AUTO"}).preload_bytes is None


def test_a_variable_that_is_not_a_setting_is_named_and_changes_nothing() -> None:
    """A typo (or a setting another version had) is listed for one startup warning, and the
    settings read are those without it."""
    s = read_settings({"GALAHAD_CACHEDIR": "/srv/kv", "GALAHAD_SAVE_THREADS": "2", "GALAHAD_MIN_TOKENS": "64"})
    assert s.unknown == ("GALAHAD_CACHEDIR", "GALAHAD_SAVE_THREADS")
    assert s.min_tokens == 64 and not s.cache_dir.startswith("/srv/kv")


@pytest.mark.parametrize(("name", "value"), [("GALAHAD_TEST_PERTURB_LOAD", "slidng"),
                                             ("GALAHAD_TEST_SAVE_DELAY", "1s")])
def test_a_test_hook_that_cannot_be_read_stays_off_and_says_why(name: str, value: str) -> None:
    hooks = read_settings({name: value}).test
    assert (hooks.perturb_load, hooks.save_delay) == ("", None)
    assert len(hooks.problems) == 1 and name in hooks.problems[0] and repr(value) in hooks.problems[0]


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("GALAHAD_PAYLOAD_ORDER", "chunks", "layer, chunk"),
        ("GALAHAD_PAYLOAD_ORDER", "LAYERS", "layer, chunk"),
        ("GALAHAD_MIN_TOKENS", "-1", ">= 0"),
        ("GALAHAD_MIN_TOKENS", "many", ">= 0"),
        ("GALAHAD_ASYNC_LOAD", "maybe", "on, off"),
        ("GALAHAD_MAX_BYTES", "lots", "80G"),
        ("GALAHAD_PRELOAD_BYTES", "all", "auto, 0 (off) or a byte count"),
        ("GALAHAD_PRELOAD_BYTES", "-1G", "auto, 0 (off) or a byte count"),
        ("GALAHAD_MAX_BYTES", "0", "positive"),
        ("GALAHAD_MAX_BYTES", "5i", "80G"),
        ("GALAHAD_MAX_BYTES", "5ib", "80G"),
        ("GALAHAD_MAX_BYTES", "9" * 320 + "P", "larger than any disk"),
        ("GALAHAD_MAX_BYTES", "9000P", "larger than any disk"),
        ("GALAHAD_FAULT_LOAD_RATE", "2", "between 0 and 1"),
        ("GALAHAD_FAULT_LOAD_RATE", "x", "between 0 and 1"),
        ("GALAHAD_LOAD_POLICY", "never", "auto, always"),
    ],
)
def test_a_malformed_setting_is_refused_naming_variable_value_and_choices(
    name: str, value: str, accepted: str
) -> None:
    with pytest.raises(ConfigError) as info:
        read_settings({name: value})
    message = str(info.value)
    assert name in message
    assert repr(value) in message
    assert accepted in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("123", 123), ("1k", 1024), ("500M", 500 << 20), ("80GiB", 80 << 30), ("1.5T", int(1.5 * (1 << 40)))],
)
def test_sizes_take_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("name", ["GALAHAD_KEY_FILE", "GALAHAD_KEY_COMMAND"])
@pytest.mark.parametrize("blank", ["", " ", "\t"])
def test_a_key_setting_that_is_set_but_blank_is_refused_not_read_as_no_encryption(name: str, blank: str) -> None:
    """A secret missing from a unit file's template leaves the variable empty: storing without
    encryption then would be silent, so it is refused, naming the variable and both ways out."""
    with pytest.raises(ConfigError) as info:
        read_settings({name: blank})
    message = str(info.value)
    assert name in message and "set but empty" in message and f"unset {name}" in message
    assert read_settings({}).key_file is None and read_settings({}).key_command is None  # unset: no encryption


def test_both_key_settings_are_refused_when_the_settings_are_read_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="both set"):
        read_settings({"GALAHAD_KEY_FILE": "/k", "GALAHAD_KEY_COMMAND": "cat /k"})


def test_the_default_store_comes_from_the_mapping_given_not_the_process_environment() -> None:
    assert read_settings({"XDG_CACHE_HOME": "/xdg"}).cache_dir == "/xdg/galahad/store"
    assert read_settings({"HOME": "/home/u"}).cache_dir == "/home/u/.cache/galahad/store"
    # a relative XDG_CACHE_HOME is ignored, as the XDG spec says
    assert read_settings({"XDG_CACHE_HOME": "rel", "HOME": "/home/u"}).cache_dir == "/home/u/.cache/galahad/store"
    assert read_settings({"HOME": "/home/u", "GALAHAD_KEY_FILE": "~/k"}).key_file == "/home/u/k"


def test_relative_paths_are_made_absolute_once_and_remembered_to_be_warned_of(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = read_settings({"GALAHAD_CACHE_DIR": "kv", "GALAHAD_KEY_FILE": "./keys/k", "GALAHAD_LICENCE_FILE": "/etc/l.lic"})
    assert s.cache_dir == str(tmp_path / "kv") and s.key_file == str(tmp_path / "keys" / "k")
    assert s.relative_paths == (("GALAHAD_CACHE_DIR", "kv"), ("GALAHAD_KEY_FILE", "./keys/k"))
    assert read_settings({"GALAHAD_CACHE_DIR": "/srv/kv"}).relative_paths == ()
