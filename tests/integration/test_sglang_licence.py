"""The licence checked again while SGLang serves, through the backend SGLang's own factory builds
over its real host pool: a licence that expires stops caching with one line and SGLang keeps
getting answers, never an exception; a licence file replaced by a valid one is taken.

A licence's expiry is a date, so the licence is issued to expire at the next 00:00 UTC and the
licence watch's clock is moved to a few seconds before it (the startup check keeps the real time).
"""

from __future__ import annotations

import datetime as dt
import glob
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from galahad.adapters.licence import watch
from sglang_support import harness
from sglang_support.fixtures import backends, galahad_settings, sgl  # noqa: F401 - fixtures

pytestmark = pytest.mark.sglang

PAGE = 16
REAL_CLOCK = watch.utc_now


def _issue(settings: dict[str, str], days: int) -> dt.datetime:
    """Replace the licence file (atomically) with one issued today for `days` days; its expiry."""
    from galahad.adapters.licence.issuer import issue_licence, load_issuer_key

    key = load_issuer_key(Path(settings["GALAHAD_LICENCE_ISSUER_KEY"]).parent / "issuer.key")
    today = dt.datetime.now(dt.timezone.utc).date()
    lic = Path(settings["GALAHAD_LICENCE_FILE"])
    temp = lic.with_suffix(".new")
    temp.write_bytes(issue_licence(key, "sglang-tests", 64, today, days).encode())
    temp.replace(lic)
    return dt.datetime.combine(today + dt.timedelta(days=days), dt.time(0), tzinfo=dt.timezone.utc)


def _move_clock(monkeypatch: pytest.MonkeyPatch, expires: dt.datetime, seconds: float) -> None:
    """The licence watch's clock: `expires` comes `seconds` from now."""
    offset = expires - REAL_CLOCK() - dt.timedelta(seconds=seconds)
    monkeypatch.setattr(watch, "utc_now", lambda: REAL_CLOCK() + offset)


def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
    return condition()


def _parts(settings: dict[str, str]) -> list[str]:
    """The store's block files (parts and commit markers), wherever they lie in it."""
    return sorted(glob.glob(os.path.join(settings["GALAHAD_CACHE_DIR"], "**", "*.blk"), recursive=True))


def test_a_licence_that_expires_while_sglang_serves_stops_caching_and_keeps_what_is_stored(
        sgl: Any, backends: Any, galahad_settings: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Saved and found before the expiry; at the expiry one `NOT CACHING from now on` line with
    the reason and the fix; after it nothing is found, read or written (and no error counted),
    the stored pages stay on disk, and a server started again with a renewed licence finds them."""
    expires = _issue(galahad_settings, days=1)
    _move_clock(monkeypatch, expires, 3.0)
    pool = harness.make_pool("mha", "page_first")
    harness.fill_random(pool, seed=5)
    keys = harness.page_keys(list(range(4 * PAGE)), PAGE)
    with caplog.at_level(logging.INFO, logger="galahad"):
        backend = backends(pool)
        assert backend.enabled, backend.reason
        assert all(backend.batch_set_v1(keys[:2], pool.alloc(2 * PAGE)))
        assert backend.batch_exists(keys) == 2
        stored = _parts(galahad_settings)
        assert stored
        assert _wait(lambda: not backend.enabled, 10.0)
    said = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
    assert said == [
        f"[galahad] (sglang rank 0) NOT CACHING from now on: licence refused (expired): licence "
        f"{galahad_settings['GALAHAD_LICENCE_FILE']} for sglang-tests expired on {expires.date().isoformat()}; "
        "ask your vendor for a renewed licence and replace the file; nothing more is saved or loaded (the "
        "stored entries are kept) and the engine keeps serving; caching resumes when the server restarts "
        "with a valid licence"], said
    assert backend.reason.startswith("licence refused (expired)")

    assert backend.batch_exists(keys) == 0  # nothing loaded
    assert backend.batch_get_v1(keys[:2], pool.alloc(2 * PAGE)) == [False, False]
    assert backend.batch_set_v1(keys[2:], pool.alloc(2 * PAGE)) == [False, False]  # nothing saved
    assert backend.batch_set(keys[2:], [pool.get_data_page(0, flat=True)] * 2) is False
    counts = backend.counters()
    assert counts["enabled"] is False and counts["disabled_calls"] >= 4 and counts["errors"] == 0
    assert _parts(galahad_settings) == stored  # kept

    _issue(galahad_settings, days=30)
    monkeypatch.setattr(watch, "utc_now", REAL_CLOCK)
    again = backends(harness.make_pool("mha", "page_first"))
    assert again.enabled, again.reason
    assert again.batch_exists(keys) == 2


def test_a_licence_file_replaced_by_a_valid_one_while_sglang_serves_is_taken(
        sgl: Any, backends: Any, galahad_settings: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A renewed licence installed before the old one expires is read at the next check (every few
    minutes; here a fifth of a second), said once at INFO, and caching goes on past the old expiry."""
    expires = _issue(galahad_settings, days=1)
    _move_clock(monkeypatch, expires, 2.0)
    monkeypatch.setattr(watch, "CHECK_EVERY_S", 0.2)
    pool = harness.make_pool("mha", "page_first")
    harness.fill_random(pool, seed=6)
    keys = harness.page_keys(list(range(4 * PAGE)), PAGE)
    with caplog.at_level(logging.INFO, logger="galahad"):
        backend = backends(pool)
        assert backend.enabled, backend.reason
        renewed = _issue(galahad_settings, days=30)
        assert _wait(lambda: "the licence file changed" in caplog.text, 5.0)
        time.sleep(3.0)  # past the first licence's expiry
    assert [r.getMessage() for r in caplog.records if "licence file changed" in r.getMessage()] == [
        "[galahad] (sglang rank 0) the licence file changed and is valid: licence OK: sglang-tests, 64 points, "
        f"expires {renewed.date().isoformat()}"]
    assert "NOT CACHING" not in caplog.text
    assert backend.enabled and backend.reason == ""
    assert all(backend.batch_set_v1(keys, pool.alloc(4 * PAGE)))
    assert backend.batch_exists(keys) == 4
