"""The error hierarchy. One root; each public error is also the builtin a caller would catch."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ForeignBlock",
    "FormatError",
    "GalahadError",
    "HelperLost",
    "IntegrityError",
    "NewerFormat",
    "KeyRefused",
    "UnknownKey",
    "LicenceRefused",
    "StoreUnavailable",
]


class GalahadError(Exception):
    """Root of every error Galahad raises on purpose.

    Engine hooks catch this (and anything else) at their boundary, log once, count, and degrade:
    the serving engine never sees it.
    """


class FormatError(GalahadError, ValueError):
    """Bytes that are not a valid block file of a format we read.

    Raised by the format codec for damaged, truncated, foreign or future files. The caller treats
    the block as a miss (and quarantines it when it came from the store); never serves it.
    """


class NewerFormat(FormatError):
    """A block of a format this reader does not read: a newer major version, or an incompat flag
    it does not know (a newer writer's layout).

    A miss, counted as `refused_format`, and never quarantined or deleted: a newer server sharing
    the store reads it, so a fleet upgraded one server at a time loses nothing.
    """


class IntegrityError(FormatError):
    """A header checksum, frame checksum or AEAD tag that does not match: damaged or tampered bytes.

    The block is a miss, counted as `refused_damaged`, and its entry is quarantined.
    """


class ForeignBlock(FormatError):
    """A valid block that belongs elsewhere: another namespace, chain key, rank or world size.

    A miss, counted as `refused_namespace`; never served, never an error.
    """


class UnknownKey(FormatError):
    """A block sealed under a key we do not hold (another deployment, or a key retired and dropped).

    A miss, counted as `refused_key`; never an error.
    """


class HelperLost(GalahadError, RuntimeError):
    """A helper process died, hung or broke its protocol. The helpers are off from then on; the
    caller reads the part in its own process (nothing is lost but the speed)."""


class StoreUnavailable(GalahadError, OSError):
    """The storage medium failed (I/O error, full disk, permissions, vanished folder).

    A save that meets it is skipped and counted; a load that meets it is a miss. Nothing stored
    before is lost because of it.
    """


class LicenceRefused(GalahadError, PermissionError):
    """A licence that does not allow caching. The caller serves without caching and says why once."""


class ConfigError(GalahadError, ValueError):
    """A malformed or unknown setting. The message names the setting, the value and what is accepted.

    Raised at startup only; the process refuses to start rather than run with a setting it
    silently ignored.
    """


class KeyRefused(GalahadError, PermissionError):
    """An encryption key that cannot be used (unreadable, wrong size, too open permissions).

    Raised at startup; the message names the key source and the fix.
    """
