"""Forged licences are refused: an extended expiry, a malleated signature (the same signature
written another way), a signature moved onto another payload. Real Ed25519 keys and licences
signed by the project's own issuer code."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from galahad.adapters.licence import EdLicence, SignedLicence
from galahad.adapters.licence.issuer import issue_licence
from galahad.domain.licence import RefusalReason

ISSUED = dt.date(2026, 11, 1)
DURING = dt.datetime(2026, 11, 15, 12, tzinfo=dt.timezone.utc)
LATER = dt.datetime(2027, 6, 1, tzinfo=dt.timezone.utc)
ISSUER = Ed25519PrivateKey.generate()
# the order of Ed25519's group: a signature (R, S) and (R, S + L) verify alike in a lax verifier
L = 2**252 + 27742317777372353535851937790883648493


def _files(tmp_path: Path, raw: bytes) -> tuple[str, str]:
    pub = tmp_path / "issuer.pub"
    pub.write_bytes(ISSUER.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    lic = tmp_path / "licence.lic"
    lic.write_bytes(raw)
    return str(lic), str(pub)


def _genuine(points: int = 2, days: int = 30) -> SignedLicence:
    return SignedLicence.decode(issue_licence(ISSUER, "Acme", points, ISSUED, days).encode())


def test_the_genuine_licence_is_valid(tmp_path: Path) -> None:
    assert EdLicence(*_files(tmp_path, _genuine().encode())).check(2, now=DURING).valid


def test_an_extended_expiry_is_a_bad_signature(tmp_path: Path) -> None:
    signed = _genuine()
    payload = signed.payload.replace(b'"expires":"2026-12-01"', b'"expires":"2036-12-01"')
    assert payload != signed.payload
    status = EdLicence(*_files(tmp_path, SignedLicence(payload, signed.signature).encode())).check(2, now=LATER)
    assert status.reason is RefusalReason.BAD_SIGNATURE


def test_a_malleated_signature_is_refused(tmp_path: Path) -> None:
    signed = _genuine()
    r, s = signed.signature[:32], int.from_bytes(signed.signature[32:], "little")
    malleated = r + (s + L).to_bytes(32, "little")
    assert malleated != signed.signature
    status = EdLicence(*_files(tmp_path, SignedLicence(signed.payload, malleated).encode())).check(2, now=DURING)
    assert status.reason is RefusalReason.BAD_SIGNATURE


def test_a_signature_moved_onto_another_licences_payload_is_refused(tmp_path: Path) -> None:
    small, large = _genuine(points=1), _genuine(points=64)
    status = EdLicence(*_files(tmp_path, SignedLicence(large.payload, small.signature).encode())).check(64, now=DURING)
    assert status.reason is RefusalReason.BAD_SIGNATURE
