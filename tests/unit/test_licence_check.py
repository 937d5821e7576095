"""EdLicence, the `Licence` port: each way a licence fails gives its own reason and a fix; `check`
never raises."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from galahad.adapters.licence import EdLicence, SignedLicence
from galahad.adapters.licence.issuer import fingerprint, issue_licence
from galahad.domain.licence import LicenceStatus, RefusalReason
from galahad.ports.licence import Licence

ISSUED = dt.date(2026, 11, 1)
DURING = dt.datetime(2026, 11, 15, 12, tzinfo=dt.timezone.utc)
ISSUER = Ed25519PrivateKey.generate()
STRANGER = Ed25519PrivateKey.generate()


def _public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture
def issuer_pub(tmp_path: Path) -> Path:
    path = tmp_path / "issuer.pub"
    path.write_bytes(_public_pem(ISSUER))
    return path


def _licence(tmp_path: Path, key: Ed25519PrivateKey = ISSUER, points: int = 8, days: int = 30,
             raw: bytes | None = None) -> Path:
    path = tmp_path / "licence.lic"
    path.write_bytes(raw if raw is not None else issue_licence(key, "Acme", points, ISSUED, days).encode())
    return path


def _check(licence: Path | None, issuer: Path | None, ranks: int = 8, now: dt.datetime = DURING) -> LicenceStatus:
    port: Licence = EdLicence(str(licence) if licence else None, str(issuer) if issuer else None)
    return port.check(ranks, now=now)


def test_a_licence_signed_by_a_trusted_issuer_for_enough_points_is_valid(tmp_path: Path, issuer_pub: Path) -> None:
    status = _check(_licence(tmp_path), issuer_pub)
    assert status.valid and status.reason is None
    assert (status.licensee, status.points) == ("Acme", 8)
    assert status.expires == dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    assert status.describe() == "licence OK: Acme, 8 points, expires 2026-12-01"
    assert _check(_licence(tmp_path), issuer_pub, ranks=3).valid


def test_a_licence_expires_at_midnight_utc_of_its_expiry_date(tmp_path: Path, issuer_pub: Path) -> None:
    licence = _licence(tmp_path)
    end = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    assert _check(licence, issuer_pub, now=end - dt.timedelta(microseconds=1)).valid
    status = _check(licence, issuer_pub, now=end)
    assert not status.valid and status.reason is RefusalReason.EXPIRED
    assert "expired on 2026-12-01" in status.detail and "renewed licence" in status.detail
    assert status.licensee == "Acme"
    assert _check(licence, issuer_pub, now=dt.datetime(2026, 12, 1, 0, 0, 1)).reason is RefusalReason.EXPIRED  # naive=UTC


def test_the_current_time_is_used_when_none_is_given(tmp_path: Path, issuer_pub: Path) -> None:
    today = dt.datetime.now(dt.timezone.utc).date()
    current = tmp_path / "current.lic"
    current.write_bytes(issue_licence(ISSUER, "Acme", 8, today - dt.timedelta(days=1), 3).encode())
    old = tmp_path / "old.lic"
    old.write_bytes(issue_licence(ISSUER, "Acme", 8, today - dt.timedelta(days=30), 29).encode())
    assert EdLicence(str(current), str(issuer_pub)).check(1).valid
    assert EdLicence(str(old), str(issuer_pub)).check(1).reason is RefusalReason.EXPIRED


def test_too_few_points_for_the_ranks_is_refused_naming_both_numbers(tmp_path: Path, issuer_pub: Path) -> None:
    status = _check(_licence(tmp_path, points=4), issuer_pub, ranks=8)
    assert not status.valid and status.reason is RefusalReason.TOO_FEW_POINTS
    assert status.detail.startswith("no licence for 8 GPU ranks")  # the words docs/vllm.md's troubleshooting names
    assert "covers 4 GPU ranks" in status.detail and "uses 8" in status.detail and "at least 8 points" in status.detail


def test_a_licence_signed_by_an_untrusted_key_is_an_unknown_issuer(tmp_path: Path, issuer_pub: Path) -> None:
    status = _check(_licence(tmp_path, key=STRANGER), issuer_pub)
    assert status.reason is RefusalReason.UNKNOWN_ISSUER
    assert fingerprint(STRANGER.public_key()) in status.detail and "GALAHAD_LICENCE_ISSUER_KEY" in status.detail


def test_a_changed_payload_is_a_bad_signature(tmp_path: Path, issuer_pub: Path) -> None:
    raw = _licence(tmp_path, points=2).read_bytes().replace(b'"points":2', b'"points":64')
    status = _check(_licence(tmp_path, raw=raw), issuer_pub)
    assert status.reason is RefusalReason.BAD_SIGNATURE and "changed or damaged" in status.detail


def test_a_changed_signature_is_a_bad_signature(tmp_path: Path, issuer_pub: Path) -> None:
    signed = SignedLicence.decode(_licence(tmp_path).read_bytes())
    forged = SignedLicence(signed.payload, bytes([signed.signature[0] ^ 1]) + signed.signature[1:])
    assert _check(_licence(tmp_path, raw=forged.encode()), issuer_pub).reason is RefusalReason.BAD_SIGNATURE


def test_a_stranger_claiming_a_trusted_issuer_is_a_bad_signature(tmp_path: Path, issuer_pub: Path) -> None:
    theirs = SignedLicence.decode(_licence(tmp_path, key=STRANGER, points=1000).read_bytes())
    payload = theirs.payload.replace(fingerprint(STRANGER.public_key()).encode(), fingerprint(ISSUER.public_key()).encode())
    raw = SignedLicence(payload, STRANGER.sign(payload)).encode()
    assert _check(_licence(tmp_path, raw=raw), issuer_pub).reason is RefusalReason.BAD_SIGNATURE


def test_no_licence_configured_or_no_file_is_missing(tmp_path: Path, issuer_pub: Path) -> None:
    none = _check(None, issuer_pub)
    assert none.reason is RefusalReason.MISSING and none.detail.startswith("no licence: GALAHAD_LICENCE_FILE is not set")
    absent = _check(tmp_path / "nowhere.lic", issuer_pub)
    assert absent.reason is RefusalReason.MISSING and "nowhere.lic does not exist" in absent.detail


@pytest.mark.parametrize("raw", [b"", b"hello\n", b"\x00" * 100])
def test_a_file_that_is_not_a_licence_is_unreadable(tmp_path: Path, issuer_pub: Path, raw: bytes) -> None:
    status = _check(_licence(tmp_path, raw=raw), issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE and "licence.lic" in status.detail


def test_a_folder_in_place_of_the_licence_is_unreadable_and_said_to_be_a_folder(tmp_path: Path,
                                                                                issuer_pub: Path) -> None:
    (tmp_path / "dir.lic").mkdir()
    status = _check(tmp_path / "dir.lic", issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE
    assert f"{tmp_path / 'dir.lic'} is not a regular file (a folder)" in status.detail
    assert "make it readable" not in status.detail


def test_a_signed_licence_naming_another_issuer_is_unreadable(tmp_path: Path, issuer_pub: Path) -> None:
    honest = SignedLicence.decode(_licence(tmp_path).read_bytes())
    payload = honest.payload.replace(fingerprint(ISSUER.public_key()).encode(), b"f" * 32)
    status = _check(_licence(tmp_path, raw=SignedLicence(payload, ISSUER.sign(payload)).encode()), issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE and "names issuer" in status.detail


def _signed_raw(payload: bytes, key: Ed25519PrivateKey = ISSUER) -> bytes:
    return SignedLicence(payload, key.sign(payload)).encode()


def _fields(**change: object) -> dict[str, object]:
    fields = json.loads(issue_licence(ISSUER, "Acme", 8, ISSUED, 30).payload)
    fields.update(change)
    return fields


def _canonical(**change: object) -> bytes:
    return json.dumps(_fields(**change), sort_keys=True, separators=(",", ":")).encode()


DAMAGED_PAYLOADS = {
    "cut short": (lambda raw: raw[: raw.index(b'"issued"')] + raw[raw.index(b"\n"):], "not JSON"),
    "byte-order mark": (lambda raw: b"\xef\xbb\xbf" + raw, "byte-order mark (BOM)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_PAYLOADS))
@pytest.mark.parametrize("issuer_keys", ["trusted", "unset"])
def test_a_damaged_payload_line_is_unreadable_before_any_issuer_question(
        tmp_path: Path, issuer_pub: Path, damage: str, issuer_keys: str) -> None:
    change, problem = DAMAGED_PAYLOADS[damage]
    licence = _licence(tmp_path, raw=change(_licence(tmp_path).read_bytes()))
    status = _check(licence, issuer_pub if issuer_keys == "trusted" else None)
    assert status.reason is RefusalReason.UNREADABLE, status.detail
    assert str(licence) in status.detail and problem in status.detail
    assert "GALAHAD_LICENCE_ISSUER_KEY" not in status.detail  # never "install an issuer key"
    if damage == "cut short":
        assert "damaged or from a newer Galahad: ask the issuer for it again, or upgrade Galahad" in status.detail


@pytest.mark.parametrize(
    ("payload", "problem"),
    [(_canonical(format="galahad-licence-v2"), "galahad-licence-v2"),
     (_canonical(seats=4), "fields this Galahad does not know (seats)")],
)
def test_a_payload_from_a_newer_galahad_is_unreadable_whoever_signed_it(
        tmp_path: Path, issuer_pub: Path, payload: bytes, problem: str) -> None:
    status = _check(_licence(tmp_path, raw=_signed_raw(payload, STRANGER)), issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE and problem in status.detail
    assert "upgrade Galahad" in status.detail


def test_a_signed_payload_naming_a_field_twice_is_unreadable_not_the_last_value(tmp_path: Path,
                                                                                 issuer_pub: Path) -> None:
    fields = _fields(points=8)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    payload = (text[:-1] + ',"points":99}').encode()  # a second "points": json keeps the last
    status = _check(_licence(tmp_path, raw=_signed_raw(payload)), issuer_pub, ranks=16)
    assert status.reason is RefusalReason.UNREADABLE and "'points' twice" in status.detail


def test_a_signed_payload_that_is_not_canonical_is_unreadable(tmp_path: Path, issuer_pub: Path) -> None:
    payload = json.dumps(_fields(), sort_keys=True).encode()  # spaces after ':' and ','
    status = _check(_licence(tmp_path, raw=_signed_raw(payload)), issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE and "not canonical JSON" in status.detail


def test_a_signed_licensee_with_a_newline_is_unreadable(tmp_path: Path, issuer_pub: Path) -> None:
    status = _check(_licence(tmp_path, raw=_signed_raw(_canonical(licensee="Acme\nINFO forged line"))), issuer_pub)
    assert status.reason is RefusalReason.UNREADABLE and "control character" in status.detail
    assert "\n" not in status.describe()  # the server's log line stays one line


def test_a_licence_of_one_point_says_one_gpu_rank(tmp_path: Path, issuer_pub: Path) -> None:
    status = _check(_licence(tmp_path, points=1), issuer_pub, ranks=2)
    assert status.reason is RefusalReason.TOO_FEW_POINTS
    assert "covers 1 GPU rank and" in status.detail and "1 GPU ranks" not in status.detail


PRIVATE_WARNING = "an issuer PRIVATE key is on this server: {}; remove it, servers need only the .pub"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_private_key_given_as_the_issuer_key_is_never_used_and_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "issuer.pem"
    path.write_bytes(_private_pem())
    with caplog.at_level(logging.WARNING):
        status = _check(_licence(tmp_path), path)
    assert status.reason is RefusalReason.NO_ISSUER_KEY and "is a private key" in status.detail
    assert any(PRIVATE_WARNING.format(path) in line for line in _warnings(caplog))


@pytest.mark.parametrize("name", ["d.pem", "issuer.key"])
def test_a_private_key_in_the_issuer_folder_is_never_used_and_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str) -> None:
    folder = tmp_path / "issuers"
    folder.mkdir()
    (folder / "other.pub").write_bytes(_public_pem(STRANGER))
    (folder / name).write_bytes(_private_pem())  # ISSUER's private key: its public half is not trusted
    (folder / "store.key").write_text("0" * 64 + "\n")  # another *.key: read, not warned of
    with caplog.at_level(logging.WARNING):
        status = _check(_licence(tmp_path), folder)
    assert status.reason is RefusalReason.UNKNOWN_ISSUER  # the private key's public half was not trusted
    assert [line for line in _warnings(caplog) if "PRIVATE" in line] == [
        f"[galahad] {PRIVATE_WARNING.format(folder / name)} (keep the private key offline, with the issuer)"]


@pytest.mark.parametrize("licence", ["unset", "damaged"])
def test_a_private_key_is_warned_of_even_when_the_licence_is_refused_first(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, licence: str) -> None:
    folder = tmp_path / "issuers"
    folder.mkdir()
    (folder / "issuer.pub").write_bytes(_public_pem(ISSUER))
    (folder / "issuer.key").write_bytes(_private_pem())
    path = None if licence == "unset" else _licence(tmp_path, raw=b"{cut short\n" + b"A" * 86 + b"==\n")
    with caplog.at_level(logging.WARNING):
        status = _check(path, folder)
    assert status.reason is (RefusalReason.MISSING if licence == "unset" else RefusalReason.UNREADABLE)
    assert any(PRIVATE_WARNING.format(folder / "issuer.key") in line for line in _warnings(caplog))


def _ec_public_pem() -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _private_pem() -> bytes:
    return ISSUER.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())


@pytest.mark.parametrize(
    ("content", "problem"),
    [("unset", "not set"), ("empty", "not a PEM public key"), ("garbage", "not a PEM public key"),
     ("ec", "not an Ed25519 key"), ("private", "is a private key"), ("absent", "cannot be read")],
)
def test_no_usable_issuer_key_is_its_own_refusal(tmp_path: Path, content: str, problem: str) -> None:
    licence = _licence(tmp_path)
    path = tmp_path / "keys.pem"
    pems = {"empty": b"", "garbage": b"garbage", "ec": _ec_public_pem(), "private": _private_pem()}
    if content in pems:
        path.write_bytes(pems[content])
    status = _check(licence, None if content == "unset" else path)
    assert status.reason is RefusalReason.NO_ISSUER_KEY and problem in status.detail


def test_an_unset_issuer_key_names_the_issuer_pub_beside_the_licence_but_never_trusts_it(tmp_path: Path) -> None:
    licence = _licence(tmp_path)
    (tmp_path / "issuer.pub").write_bytes(_public_pem(ISSUER))
    status = _check(licence, None)
    assert status.reason is RefusalReason.NO_ISSUER_KEY  # still refused: the setting chooses whom to trust
    assert f"GALAHAD_LICENCE_ISSUER_KEY={tmp_path / 'issuer.pub'}" in status.detail
    (tmp_path / "issuer.pub").unlink()
    assert "beside the licence" not in _check(licence, None).detail


def test_a_folder_of_issuer_keys_trusts_each_pem_and_pub_in_it(tmp_path: Path) -> None:
    folder = tmp_path / "issuers"
    folder.mkdir()
    (folder / "old.pem").write_bytes(_public_pem(STRANGER))
    (folder / "current.pub").write_bytes(_public_pem(ISSUER))
    (folder / "notes.txt").write_text("ignored")
    (folder / "junk.pem").write_text("not a key: skipped")
    assert _check(_licence(tmp_path, key=ISSUER), folder).valid
    assert _check(_licence(tmp_path, key=STRANGER), folder).valid
    empty = tmp_path / "empty"
    empty.mkdir()
    status = _check(_licence(tmp_path), empty)
    assert status.reason is RefusalReason.NO_ISSUER_KEY and "no *.pem or *.pub file" in status.detail


def test_each_failure_gives_its_own_reason(tmp_path: Path, issuer_pub: Path) -> None:
    reasons = {
        _check(None, issuer_pub).reason,
        _check(_licence(tmp_path, raw=b"x"), issuer_pub).reason,
        _check(_licence(tmp_path), None).reason,
        _check(_licence(tmp_path, key=STRANGER), issuer_pub).reason,
        _check(_licence(tmp_path, raw=_licence(tmp_path).read_bytes().replace(b"Acme", b"Acmf")), issuer_pub).reason,
        _check(_licence(tmp_path), issuer_pub, now=DURING + dt.timedelta(days=365)).reason,
        _check(_licence(tmp_path, points=1), issuer_pub, ranks=2).reason,
    }
    assert reasons == set(RefusalReason)


def test_paths_no_file_can_have_are_refused_not_raised(tmp_path: Path, issuer_pub: Path) -> None:
    assert _check(Path("bad\x00name.lic"), issuer_pub).reason is RefusalReason.UNREADABLE
    assert _check(_licence(tmp_path), Path("bad\x00name.pub")).reason is RefusalReason.NO_ISSUER_KEY


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300), ranks=st.integers(1, 64))
def test_check_never_raises_whatever_the_file_holds(tmp_path: Path, issuer_pub: Path, raw: bytes, ranks: int) -> None:
    status = _check(_licence(tmp_path, raw=raw), issuer_pub, ranks=ranks)
    assert not status.valid and status.reason is not None and status.detail



def test_a_valid_licence_of_one_point_says_point_in_the_singular() -> None:
    from galahad.domain.licence import LicenceStatus

    one = LicenceStatus(valid=True, licensee="Acme", points=1, expires=dt.datetime(2026, 12, 1))
    assert one.describe() == "licence OK: Acme, 1 point, expires 2026-12-01"
    assert "8 points" in LicenceStatus(valid=True, licensee="Acme", points=8).describe()
