"""A `GALAHAD_*` variable that is not a setting (a typo, or a setting of another version) is named
in one startup warning and changes nothing; a test hook that cannot be read says so and stays
off. Through `open_cache`, as an engine adapter opens the cache (a real licence, a real store)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from galahad.bootstrap import open_cache
from galahad.config import read_settings
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from vllm_support.licence import make_licence

NS = Namespace(model="settings", model_fingerprint="settings", dtype="float32",
               kv_cache_dtype="auto", block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 1),),
               payload_order=PayloadOrder.LAYER)


def _open(tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: dict[str, str]) -> list[str]:
    lic, pub = make_licence(tmp_path / "lic")
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
           "GALAHAD_LICENCE_ISSUER_KEY": pub, **extra}
    with caplog.at_level(logging.INFO, logger="galahad"):
        handle = open_cache(read_settings(env), NS, RankLayout())
    assert handle.service is not None, handle.reason  # still caching
    handle.service.close()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_variable_that_is_not_a_setting_gets_one_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    warnings = _open(tmp_path, caplog, {"GALAHAD_MIN_TOKEN": "64", "GALAHAD_SAVE_THREADS": "2"})
    for name in ("GALAHAD_MIN_TOKEN", "GALAHAD_SAVE_THREADS"):
        said = [w for w in warnings if name in w]
        assert len(said) == 1 and "is not a Galahad setting and is ignored" in said[0]
        assert "docs/configuration.md" in said[0]


def test_settings_alone_give_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _open(tmp_path, caplog, {"GALAHAD_MIN_TOKENS": "64"}) == []


def test_a_test_hook_that_cannot_be_read_is_said_once_and_stays_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    warnings = _open(tmp_path, caplog, {"GALAHAD_TEST_SAVE_DELAY": "soon"})
    assert [w for w in warnings if "GALAHAD_TEST_SAVE_DELAY='soon'" in w and "stays off" in w]
