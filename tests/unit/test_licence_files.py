"""The files a licence check reads are opened without blocking: a FIFO (or a folder, or a device)
where the licence or an issuer key should be is refused at once, naming what it is."""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from galahad.adapters.licence import EdLicence
from galahad.adapters.licence.issuer import issue_licence, load_issuer_key
from galahad.domain.licence import LicenceStatus, RefusalReason

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")

ISSUER = Ed25519PrivateKey.generate()
DURING = dt.datetime(2026, 11, 15, tzinfo=dt.timezone.utc)
T = TypeVar("T")


@pytest.fixture
def fifos(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Makes FIFOs; afterwards, opens each for writing once so a reader stuck on it (a regression)
    gets its end of file and its thread ends."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waiting: nothing to release


def _within(seconds: float, call: Callable[[], T]) -> T:
    """`call()`'s result, or a test failure when it has not returned after `seconds` (it hangs)."""
    results: list[T] = []
    worker = threading.Thread(target=lambda: results.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s: a FIFO was opened as a blocking file"
    assert results, "the call raised (see the thread's exception above)"
    return results[0]


def _licence(tmp_path: Path) -> Path:
    path = tmp_path / "licence.lic"
    path.write_bytes(issue_licence(ISSUER, "Acme", 8, dt.date(2026, 11, 1), 30).encode())
    return path


def _issuer_pub(folder: Path) -> Path:
    path = folder / "issuer.pub"
    path.write_bytes(ISSUER.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def _check(licence: Path, issuer_keys: Path) -> LicenceStatus:
    return _within(5, lambda: EdLicence(str(licence), str(issuer_keys)).check(1, now=DURING))


def test_a_fifo_as_the_licence_file_is_refused_at_once_as_not_a_regular_file(
        tmp_path: Path, fifos: Callable[[Path], Path]) -> None:
    fifo = fifos(tmp_path / "licence.lic")
    status = _check(fifo, _issuer_pub(tmp_path))
    assert status.reason is RefusalReason.UNREADABLE
    assert f"{fifo} is not a regular file (a FIFO)" in status.detail
    assert "point GALAHAD_LICENCE_FILE at the licence file" in status.detail


def test_a_fifo_named_pem_in_the_issuer_folder_is_skipped_like_any_unusable_file(
        tmp_path: Path, fifos: Callable[[Path], Path]) -> None:
    folder = tmp_path / "issuers"
    folder.mkdir()
    fifos(folder / "a-fifo.pem")
    _issuer_pub(folder)
    assert _check(_licence(tmp_path), folder).valid


def test_a_fifo_as_the_issuer_key_is_no_issuer_key_naming_the_fifo(
        tmp_path: Path, fifos: Callable[[Path], Path]) -> None:
    fifo = fifos(tmp_path / "issuer.pem")
    status = _check(_licence(tmp_path), fifo)
    assert status.reason is RefusalReason.NO_ISSUER_KEY and "not a regular file (a FIFO)" in status.detail


def test_a_fifo_as_the_private_key_to_issue_with_is_refused_at_once(
        tmp_path: Path, fifos: Callable[[Path], Path]) -> None:
    fifo = fifos(tmp_path / "issuer.key")

    def load() -> str:
        try:
            load_issuer_key(fifo)
        except ValueError as exc:
            return str(exc)
        return "loaded"

    assert "is not a regular file (a FIFO)" in _within(5, load)


def test_a_device_as_the_licence_file_is_refused_naming_what_it_is(tmp_path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    status = _check(Path("/dev/zero"), _issuer_pub(tmp_path))
    assert status.reason is RefusalReason.UNREADABLE and "(a character device)" in status.detail
