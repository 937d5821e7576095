"""The `Licence` port: an Ed25519-signed licence file checked against trusted issuer keys."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from galahad.adapters.licence.document import LicenceInvalid, LicenceTerms, SignedLicence
from galahad.adapters.licence.issuer import PUBLIC_KEY_NAME, load_trusted_keys, verifying_key
from galahad.domain.licence import LicenceStatus, RefusalReason
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular

__all__ = ["EdLicence", "judge", "read_licence", "read_terms"]

_MAX_FILE_BYTES = 64 * 1024


class EdLicence:
    """Checks `licence_file` (`GALAHAD_LICENCE_FILE`) against the issuer public keys at
    `issuer_keys` (`GALAHAD_LICENCE_ISSUER_KEY`: a PEM file or a folder of them).

    Building one does no I/O; each `check` reads both afresh. A server checks once at startup
    (`bootstrap.open_cache`), then again while it runs through `LicenceWatch` (at the expiry and
    every few minutes): that is how a replaced licence is seen without a restart. `check` never
    raises: it returns a valid status or a refusal whose detail says what to do. Refusals, in
    the order they are looked for: missing, unreadable (the file, or a payload this version
    cannot read: damaged, a byte-order mark, a newer format), no issuer key, unknown issuer, bad
    signature, unreadable (a signed payload naming another issuer than its signer), expired, too
    few points.
    """

    def __init__(self, licence_file: str | None, issuer_keys: str | None) -> None:
        self.licence_file = licence_file or None
        self.issuer_keys = issuer_keys or None

    def __repr__(self) -> str:
        return f"EdLicence(licence_file={self.licence_file!r}, issuer_keys={self.issuer_keys!r})"

    def check(self, ranks: int, now: dt.datetime | None = None) -> LicenceStatus:
        """Whether the licence covers `ranks` GPU ranks (tensor x pipeline x data parallel: every
        GPU rank of the deployment) at `now` (default: the current time, UTC)."""
        try:
            terms = self.verified_terms()
        except LicenceInvalid as exc:
            return LicenceStatus(valid=False, reason=exc.reason, detail=exc.detail)
        return judge(terms, ranks, now, where=str(self.licence_file))

    def verified_terms(self) -> LicenceTerms:
        """The terms of the licence file, its signature checked; `LicenceInvalid` otherwise.

        The issuer keys are read first, so a private key among them is warned of whatever else is
        wrong; their refusal (no issuer key) still comes after the licence file's own.
        """
        trusted = _trusted_keys_or_refusal(self.issuer_keys)
        if self.licence_file is None:
            raise LicenceInvalid(RefusalReason.MISSING, "no licence: GALAHAD_LICENCE_FILE is not set; set it to "
                                 "the licence file you were issued (caching stays off until then)")
        signed, terms = read_terms(self.licence_file)
        if isinstance(trusted, LicenceInvalid):
            beside = Path(self.licence_file).parent / PUBLIC_KEY_NAME
            if self.issuer_keys is None and beside.is_file():  # named, never trusted unasked
                raise LicenceInvalid(trusted.reason, f"{trusted.detail}; there is one beside the licence: "
                                     f"GALAHAD_LICENCE_ISSUER_KEY={beside}")
            raise trusted
        issuer = verifying_key(signed, trusted)
        if terms.issuer != issuer:
            raise LicenceInvalid(RefusalReason.UNREADABLE, f"licence file {self.licence_file} names issuer "
                                 f"{terms.issuer} but was signed by {issuer}; ask the issuer for a new licence")
        return terms


def _trusted_keys_or_refusal(issuer_keys: str | None) -> dict[str, Ed25519PublicKey] | LicenceInvalid:
    try:
        return load_trusted_keys(issuer_keys)
    except LicenceInvalid as exc:
        return exc


def read_licence(path: str) -> SignedLicence:
    """The two lines of the licence file at `path`; `LicenceInvalid` (missing or unreadable)."""
    try:
        raw = read_regular(path, _MAX_FILE_BYTES)
    except FileNotFoundError as exc:
        raise LicenceInvalid(RefusalReason.MISSING, f"licence file {path} does not exist; put the licence "
                             "file you were issued there, or fix GALAHAD_LICENCE_FILE") from exc
    except NotARegularFile as exc:
        raise LicenceInvalid(RefusalReason.UNREADABLE, f"licence file {exc}; point GALAHAD_LICENCE_FILE "
                             "at the licence file") from exc
    except (OSError, ValueError) as exc:  # ValueError: a path holding a NUL
        reason = getattr(exc, "strerror", None) or str(exc)
        raise LicenceInvalid(RefusalReason.UNREADABLE, f"licence file {path!r} cannot be read ({reason}); "
                             "make it readable by the user running the server") from exc
    try:
        return SignedLicence.decode(raw)
    except LicenceInvalid as exc:
        raise LicenceInvalid(exc.reason, f"licence file {path}: {exc.detail}") from exc


def read_terms(path: str) -> tuple[SignedLicence, LicenceTerms]:
    """The licence file at `path` and the terms its payload states, not yet verified: a signature
    check (`verifying_key`) must come before they are trusted. `LicenceInvalid` (missing, unreadable)."""
    signed = read_licence(path)
    try:
        return signed, LicenceTerms.from_payload(signed.payload)
    except LicenceInvalid as exc:
        raise LicenceInvalid(exc.reason, f"licence file {path}: {exc.detail}") from exc


def judge(terms: LicenceTerms, ranks: int, now: dt.datetime | None, where: str) -> LicenceStatus:
    """Whether verified `terms` cover `ranks` GPU ranks at `now` (default: the current time, UTC)."""
    moment = now or dt.datetime.now(dt.timezone.utc)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    reason, detail = None, ""
    if moment >= terms.expires_at:
        reason = RefusalReason.EXPIRED
        detail = (f"licence {where} for {terms.licensee} expired on {terms.expires.isoformat()}; ask your "
                  "vendor for a renewed licence and replace the file")
    elif terms.points < ranks:
        reason = RefusalReason.TOO_FEW_POINTS
        detail = (f"no licence for {ranks} GPU ranks: licence {where} covers {_count(terms.points, 'GPU rank')} "
                  f"and this server uses {ranks} (tensor x pipeline x data parallel); ask for a licence of at "
                  f"least {ranks} points, or run on fewer GPUs")
    return LicenceStatus(valid=reason is None, reason=reason, detail=detail, licensee=terms.licensee,
                         points=terms.points, expires=terms.expires_at)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
