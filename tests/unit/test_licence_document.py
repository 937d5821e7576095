"""The licence file format, galahad-licence-v1: canonical payload, two lines, strict reading."""

from __future__ import annotations

import base64
import datetime as dt
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from galahad.adapters.licence.document import LicenceInvalid, LicenceTerms, SignedLicence
from galahad.adapters.licence.issuer import issue_licence
from galahad.domain.error import LicenceRefused
from galahad.domain.licence import RefusalReason

TERMS = LicenceTerms("Acme", 8, dt.date(2026, 11, 30), dt.date(2027, 11, 30), "0123456789abcdef" * 2)
SIGNATURE = bytes(range(64))


def test_the_payload_is_canonical_json_of_the_documented_fields() -> None:
    assert TERMS.payload() == (
        b'{"expires":"2027-11-30","format":"galahad-licence-v1","issued":"2026-11-30",'
        b'"issuer":"0123456789abcdef0123456789abcdef","licensee":"Acme","points":8}'
    )
    assert LicenceTerms.from_payload(TERMS.payload()) == TERMS


def test_a_licence_is_the_payload_line_and_the_base64_signature_line() -> None:
    signed = SignedLicence(TERMS.payload(), SIGNATURE)
    raw = signed.encode()
    assert raw == TERMS.payload() + b"\n" + base64.b64encode(SIGNATURE) + b"\n"
    assert SignedLicence.decode(raw) == signed
    assert SignedLicence.decode(raw.replace(b"\n", b"\r\n") + b"\n\n") == signed  # edited on Windows
    assert signed.claimed_issuer() == TERMS.issuer


def test_the_expiry_instant_is_midnight_utc_of_the_expiry_date() -> None:
    assert TERMS.expires_at == dt.datetime(2027, 11, 30, tzinfo=dt.timezone.utc)


def _payload(**change: object) -> bytes:
    fields = json.loads(TERMS.payload())
    fields.update(change)
    return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "not JSON"),
        (_payload(format="galahad-licence-v2"), "format"),
        (_payload(format=None), "format"),
        (_payload(features=["x"]), "fields this Galahad does not know (features)"),
        (_payload(licensee=""), "licensee"),
        (_payload(licensee=7), "licensee"),
        (_payload(points=0), "points"),
        (_payload(points=True), "points"),
        (_payload(points="8"), "points"),
        (_payload(points=2.5), "points"),
        (_payload(issued="30/11/2026"), "issued date"),
        (_payload(expires="2027-02-30"), "expires date"),
        (_payload(expires=None), "expires date"),
        (_payload(expires="2026-11-30"), "expires before it was issued"),
        (_payload(issuer="ABC"), "issuer"),
        (b"[" * 100_000, "not JSON"),
        (b"\xef\xbb\xbf" + TERMS.payload(), "starts with a UTF-8 byte-order mark (BOM)"),
        (TERMS.payload()[:-1] + b',"points":99}', "names the field 'points' twice"),
        (json.dumps(json.loads(TERMS.payload())).encode(), "not canonical JSON"),
        (_payload(licensee="Acme\nINFO forged"), "licensee holds a control character ('\\n')"),
        (_payload(licensee="Acme\u2028GmbH"), "licensee holds a control character"),
    ],
)
def test_a_payload_that_is_not_v1_is_unreadable_with_the_problem_named(payload: bytes, problem: str) -> None:
    with pytest.raises(LicenceInvalid) as caught:
        LicenceTerms.from_payload(payload)
    assert caught.value.reason is RefusalReason.UNREADABLE and problem in caught.value.detail
    assert isinstance(caught.value, LicenceRefused)


@pytest.mark.parametrize("payload", [b"not json", b'{"expires":"2027-11-30","format":', _payload(points=0)])
def test_an_unreadable_payload_says_what_to_do(payload: bytes) -> None:
    with pytest.raises(LicenceInvalid) as caught:
        LicenceTerms.from_payload(payload)
    assert "ask the issuer" in caught.value.detail or "upgrade Galahad" in caught.value.detail


def test_a_licensee_that_would_split_a_log_line_is_never_signed() -> None:
    with pytest.raises(LicenceInvalid) as caught:
        issue_licence(Ed25519PrivateKey.generate(), "Acme\nGmbH", 1, dt.date(2026, 11, 30), 30)
    assert "control character" in caught.value.detail


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"", "0 non-empty lines"),
        (TERMS.payload(), "1 non-empty lines"),
        (TERMS.payload() + b"\nAAAA\nBBBB\n", "3 non-empty lines"),
        (TERMS.payload() + b"\n!!not base64!!\n", "not base64"),
        (TERMS.payload() + b"\n" + base64.b64encode(bytes(63)) + b"\n", "63 bytes"),
        (b"x" * 70_000, "over 64 KiB"),
    ],
)
def test_a_file_that_is_not_two_lines_is_unreadable(raw: bytes, problem: str) -> None:
    with pytest.raises(LicenceInvalid) as caught:
        SignedLicence.decode(raw)
    assert caught.value.reason is RefusalReason.UNREADABLE and problem in caught.value.detail


@given(st.binary(max_size=400))
def test_arbitrary_bytes_decode_or_are_refused_as_unreadable(raw: bytes) -> None:
    try:
        signed = SignedLicence.decode(raw)
        LicenceTerms.from_payload(signed.payload)
    except LicenceInvalid as exc:
        assert exc.reason is RefusalReason.UNREADABLE
