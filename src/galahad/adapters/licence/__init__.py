"""Licences: Ed25519-signed licence files, checked against trusted issuer keys."""

from galahad.adapters.licence.document import LICENCE_FORMAT, LicenceInvalid, LicenceTerms, SignedLicence
from galahad.adapters.licence.ed25519 import EdLicence
from galahad.adapters.licence.watch import LicenceWatch

__all__ = ["LICENCE_FORMAT", "EdLicence", "LicenceInvalid", "LicenceTerms", "LicenceWatch", "SignedLicence"]
