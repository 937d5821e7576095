"""The licence file, `galahad-licence-v1`: two text lines, a signed payload and its signature.

    {"expires":"2027-11-30","format":"galahad-licence-v1","issued":"2026-11-30","issuer":"<fp>","licensee":"Acme","points":8}
    <base64 of the 64-byte Ed25519 signature over the exact bytes of line 1>

Line 1 is canonical JSON (sorted keys, no spaces, ASCII); the signature covers its bytes exactly
as they stand (no re-serialising), and nothing else in the file is trusted. docs/security.md
documents each field.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import re
import unicodedata
from typing import Any, NoReturn

import attrs

from galahad.domain.error import LicenceRefused
from galahad.domain.licence import RefusalReason

__all__ = ["LICENCE_FORMAT", "LicenceInvalid", "LicenceTerms", "SignedLicence", "licensee_problem"]

LICENCE_FORMAT = "galahad-licence-v1"
SIGNATURE_BYTES = 64
_MAX_FILE_BYTES = 64 * 1024
_MAX_LICENSEE_CHARS = 200
_FIELDS = frozenset({"format", "licensee", "points", "issued", "expires", "issuer"})
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_BOM = b"\xef\xbb\xbf"
_LINE_BREAKING = frozenset({"Cc", "Zl", "Zp"})  # control characters, line and paragraph separators
_DAMAGED = "the licence file is damaged or from a newer Galahad: ask the issuer for it again, or upgrade Galahad"
_AS_ISSUED = "replace it with the licence file as issued"


class LicenceInvalid(LicenceRefused):
    """A licence that cannot be used, with the reason a `LicenceStatus` reports.

    Raised inside the licence adapter and by the `galahad-licence` tool; `EdLicence.check` turns
    it into a refused status, so it never crosses the `Licence` port. `detail` says what to do.
    """

    def __init__(self, reason: RefusalReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@attrs.frozen
class LicenceTerms:
    """What a licence grants: `points` GPU ranks (tensor x pipeline x data parallel, over the whole
    deployment) to `licensee` until `expires` (00:00 UTC of that day, exclusive), signed by the
    issuer whose key fingerprint is `issuer`."""

    licensee: str
    points: int
    issued: dt.date
    expires: dt.date
    issuer: str

    @property
    def expires_at(self) -> dt.datetime:
        """The instant the licence stops being valid."""
        return dt.datetime.combine(self.expires, dt.time(0), tzinfo=dt.timezone.utc)

    def payload(self) -> bytes:
        """Line 1 of the file: canonical JSON, the bytes the issuer signs."""
        fields = {"format": LICENCE_FORMAT, "licensee": self.licensee, "points": self.points,
                  "issued": self.issued.isoformat(), "expires": self.expires.isoformat(), "issuer": self.issuer}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_payload(cls, payload: bytes) -> LicenceTerms:
        """The terms line 1 states; `LicenceInvalid(UNREADABLE)` when it is not a v1 payload exactly
        as `payload` writes it (canonical, each field once, no byte-order mark)."""
        fields = _json_object(payload)
        if fields.get("format") != LICENCE_FORMAT:
            _unreadable(f"its format is {fields.get('format')!r}, this Galahad reads {LICENCE_FORMAT!r}",
                        "upgrade Galahad, or ask the issuer for a v1 licence")
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            _unreadable(f"it has fields this Galahad does not know ({', '.join(unknown)})",
                        "upgrade Galahad, or ask the issuer for a v1 licence")
        licensee, points, issuer = fields.get("licensee"), fields.get("points"), fields.get("issuer")
        if not isinstance(licensee, str) or not 0 < len(licensee) <= _MAX_LICENSEE_CHARS:
            _unreadable("its licensee is not a name of 1 to 200 characters")
        if problem := licensee_problem(licensee):
            _unreadable(f"its licensee {problem}")
        if not isinstance(points, int) or isinstance(points, bool) or points < 1:
            _unreadable("its points are not a whole number of at least 1")
        if not isinstance(issuer, str) or not _FINGERPRINT.fullmatch(issuer):
            _unreadable("its issuer is not a key fingerprint (32 hexadecimal digits)")
        issued, expires = _date(fields, "issued"), _date(fields, "expires")
        if expires <= issued:
            _unreadable("it expires before it was issued")
        terms = cls(licensee, points, issued, expires, issuer)
        if terms.payload() != payload:
            _unreadable("its first line is not canonical JSON (keys sorted, no spaces, ASCII), so it was "
                        "not written by galahad-licence issue", "ask the issuer for the licence file again")
        return terms


@attrs.frozen
class SignedLicence:
    """The two lines of a licence file: the payload bytes and the signature over them."""

    payload: bytes
    signature: bytes

    def encode(self) -> bytes:
        return self.payload + b"\n" + base64.b64encode(self.signature) + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> SignedLicence:
        """`LicenceInvalid(UNREADABLE)` unless `raw` is a payload line and a signature line."""
        if len(raw) > _MAX_FILE_BYTES:
            _unreadable(f"it is over {_MAX_FILE_BYTES // 1024} KiB", _AS_ISSUED)
        lines = [line.strip() for line in raw.splitlines() if line.strip()]
        if len(lines) != 2:
            _unreadable(f"it has {len(lines)} non-empty lines, a licence has 2 (payload, signature)", _AS_ISSUED)
        payload, signature_text = lines
        try:
            signature = base64.b64decode(signature_text, validate=True)
        except (binascii.Error, ValueError):
            _unreadable("its second line is not base64", _AS_ISSUED)
        if len(signature) != SIGNATURE_BYTES:
            _unreadable(f"its signature is {len(signature)} bytes, an Ed25519 signature is {SIGNATURE_BYTES}",
                        _AS_ISSUED)
        return cls(payload, signature)

    def claimed_issuer(self) -> str | None:
        """The issuer fingerprint line 1 claims, before any check (None when there is none)."""
        try:
            issuer = _json_object(self.payload).get("issuer")
        except LicenceInvalid:
            return None
        return issuer if isinstance(issuer, str) else None


def licensee_problem(licensee: str) -> str:
    """What makes `licensee` unfit for a licence ("" when nothing): a character that would break
    the server's log line (a newline or another control character)."""
    bad = next((c for c in licensee if unicodedata.category(c) in _LINE_BREAKING), None)
    if bad is None:
        return ""
    return f"holds a control character ({bad!r}), which would split the server's log line"


def _json_object(payload: bytes) -> dict[str, Any]:
    if payload.startswith(_BOM):
        _unreadable("its first line starts with a UTF-8 byte-order mark (BOM), added by an editor",
                    "save it without the BOM (the signature covers the line as issued), or ask the issuer "
                    "for the licence file again")
    try:
        fields = json.loads(payload.decode("utf-8"), object_pairs_hook=_no_repeated_keys)
    except _RepeatedKey as exc:
        _unreadable(f"its first line names the field {exc.args[0]!r} twice, so it was not written by "
                    "galahad-licence issue", "ask the issuer for the licence file again")
    except (UnicodeDecodeError, ValueError, RecursionError):
        _unreadable("its first line (the payload) is not JSON")
    if not isinstance(fields, dict):
        _unreadable("its first line is not a JSON object")
    return fields


class _RepeatedKey(Exception):
    """A JSON object naming one key twice (which one counts differs between readers)."""


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def _date(fields: dict[str, Any], name: str) -> dt.date:
    text = fields.get(name)
    if isinstance(text, str) and _DATE.fullmatch(text):
        try:
            return dt.date.fromisoformat(text)
        except ValueError:
            pass
    _unreadable(f"its {name} date is not a date (YYYY-MM-DD)")


def _unreadable(problem: str, fix: str = _DAMAGED) -> NoReturn:
    raise LicenceInvalid(RefusalReason.UNREADABLE, f"not a valid licence: {problem}; {fix}")
