"""LicenceWatch: the licence checked again while a server runs, on real licence files signed by
the project's issuer code, with a clock moved to just before the licence's expiry instant (a
licence's expiry is a date: it cannot be issued for a few seconds)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from galahad.adapters.licence import EdLicence, LicenceWatch
from galahad.adapters.licence.issuer import issue_licence
from galahad.adapters.licence.watch import utc_now

ISSUER = Ed25519PrivateKey.generate()
TODAY = dt.datetime.now(dt.timezone.utc).date()
TOMORROW = dt.datetime.combine(TODAY + dt.timedelta(days=1), dt.time(0), tzinfo=dt.timezone.utc)


def _files(tmp_path: Path, *, days: int = 1, points: int = 2) -> tuple[Path, EdLicence]:
    """A licence issued today for `days` days (1: it expires at the next 00:00 UTC) and the check."""
    pub = tmp_path / "issuer.pub"
    pub.write_bytes(ISSUER.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    lic = tmp_path / "licence.lic"
    _issue(lic, days=days, points=points)
    return lic, EdLicence(str(lic), str(pub))


def _issue(path: Path, *, days: int, points: int = 2) -> None:
    temp = path.with_suffix(".new")
    temp.write_bytes(issue_licence(ISSUER, "Acme", points, TODAY, days).encode())
    temp.replace(path)  # as an operator installs a renewed licence: atomically


def _clock(seconds_to_expiry: float) -> Callable[[], dt.datetime]:
    """The real clock, moved so that tomorrow's 00:00 UTC comes `seconds_to_expiry` from now."""
    offset = TOMORROW - utc_now() - dt.timedelta(seconds=seconds_to_expiry)
    return lambda: utc_now() + offset


def _started(licence: EdLicence, clock: Callable[[], dt.datetime], **kw: float) -> tuple[LicenceWatch, list[str]]:
    status = licence.check(2, now=clock())
    assert status.valid, status.detail
    watch = LicenceWatch(licence, 2, status, who=" (test)", clock=clock, **kw)
    said: list[str] = []
    watch.start(said.append)
    return watch, said


def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_licence_that_expires_while_running_stops_caching_at_its_expiry_with_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At the expiry instant (not at the next periodic check: that is minutes away) the watch
    checks, confirms the refusal once, says so in one line naming the fix, and calls its stop
    function once."""
    caplog.set_level(logging.INFO, logger="galahad")
    lic, licence = _files(tmp_path)
    clock = _clock(1.0)
    watch, said = _started(licence, clock)
    assert not _wait(lambda: bool(said), 0.7)  # still valid: nothing stopped
    assert _wait(lambda: bool(said), 5.0)
    stopped_at = clock()
    assert TOMORROW <= stopped_at < TOMORROW + dt.timedelta(seconds=3)
    reason = (f"licence refused (expired): licence {lic} for Acme expired on {TOMORROW.date().isoformat()}; "
              "ask your vendor for a renewed licence and replace the file")
    assert said == [reason] and watch.refused == reason
    assert _lines(caplog, "NOT CACHING") == [
        f"[galahad] (test) NOT CACHING from now on: {reason}; nothing more is saved or loaded (the stored "
        "entries are kept) and the engine keeps serving; caching resumes when the server restarts with a "
        "valid licence"]
    thread = watch._thread  # noqa: SLF001
    assert thread is not None and _wait(lambda: not thread.is_alive(), 2.0)  # the watch ended


def test_a_licence_replaced_by_a_valid_one_while_running_is_taken_with_its_new_expiry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="galahad")
    lic, licence = _files(tmp_path)
    watch, said = _started(licence, _clock(1.5), every_s=0.2)
    _issue(lic, days=30)
    renewed = TOMORROW + dt.timedelta(days=29)
    assert _wait(lambda: watch.expires == renewed, 3.0)
    time.sleep(2.0)  # past the first licence's expiry
    assert said == [] and watch.refused == "" and not _lines(caplog, "NOT CACHING")
    assert _lines(caplog, "licence file changed") == [
        f"[galahad] (test) the licence file changed and is valid: licence OK: Acme, 2 points, expires "
        f"{renewed.date().isoformat()}"]
    watch.close(timeout=2)


def test_a_licence_replaced_by_one_for_fewer_points_stops_caching(tmp_path: Path) -> None:
    lic, licence = _files(tmp_path, days=30)
    watch, said = _started(licence, utc_now, every_s=0.1, confirm_s=0.1)
    _issue(lic, days=30, points=1)
    assert _wait(lambda: bool(said), 3.0)
    assert said[0].startswith("licence refused (too few points): no licence for 2 GPU ranks")


def test_a_licence_file_caught_while_being_rewritten_does_not_stop_caching(tmp_path: Path) -> None:
    """`cp new.lic licence.lic` truncates, then writes: a check in between reads a damaged file.
    A refusal is checked once more before it counts, and by then the file is whole again."""
    lic, licence = _files(tmp_path, days=30)
    whole = lic.read_bytes()
    watch, said = _started(licence, utc_now, every_s=0.05, confirm_s=0.6)
    lic.write_bytes(whole[:40])
    time.sleep(0.25)  # several checks find it cut short
    lic.write_bytes(whole)
    time.sleep(1.0)
    assert said == [] and watch.refused == ""
    watch.close(timeout=2)


def test_a_closed_watch_ends_without_stopping_anything(tmp_path: Path) -> None:
    _lic, licence = _files(tmp_path)
    watch, said = _started(licence, _clock(0.5))
    watch.close(timeout=2)
    time.sleep(1.5)  # past the expiry
    assert said == [] and watch.refused == ""
    assert watch._thread is not None and not watch._thread.is_alive()  # noqa: SLF001


def test_a_stop_function_that_raises_is_contained_on_the_watch_thread(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _lic, licence = _files(tmp_path)
    clock = _clock(0.2)
    watch = LicenceWatch(licence, 2, licence.check(2, now=clock()), clock=clock)

    def broken(reason: str) -> None:
        raise RuntimeError("adapter bug")

    with caplog.at_level(logging.WARNING, logger="galahad"):
        watch.start(broken)
        assert _wait(lambda: bool(_lines(caplog, "stopping the cache")), 5.0)
    assert watch.refused.startswith("licence refused (expired)")


def test_a_private_issuer_key_on_the_server_is_warned_of_once_not_at_every_check(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every process checks its licence again every few minutes: the private-key warning, said at
    the first check, would otherwise come back each time."""
    folder = tmp_path / "issuers"
    folder.mkdir()
    _lic, licence = _files(folder, days=30)
    private = folder / "issuer.key"
    private.write_bytes(ISSUER.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    watched = EdLicence(licence.licence_file, str(folder))
    with caplog.at_level(logging.WARNING, logger="galahad"):
        for _ in range(3):
            assert watched.check(2).valid
    assert len(_lines(caplog, f"PRIVATE key is on this server: {private}")) == 1
