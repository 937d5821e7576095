"""Issuer keys: the Ed25519 pair that signs licences, and the trusted public keys that check them.

An issuer key's fingerprint is the first 32 hex digits of SHA-256 over its 32 raw public bytes.
Servers hold public keys only (`GALAHAD_LICENCE_ISSUER_KEY`: a PEM file, or a folder of `*.pem` /
`*.pub` files); the private key stays with the issuer. A private key found there (the file itself,
or a `*.pem`, `*.pub` or `*.key` in the folder) is never used and is logged as a WARNING, once
per file and process (a running server checks its licence again every few minutes).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import secrets
from pathlib import Path
from typing import NoReturn

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from galahad.adapters.licence.document import LicenceInvalid, LicenceTerms, SignedLicence
from galahad.domain.licence import RefusalReason
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular

__all__ = [
    "PRIVATE_KEY_NAME",
    "PUBLIC_KEY_NAME",
    "fingerprint",
    "generate_issuer",
    "issue_licence",
    "load_issuer_key",
    "load_trusted_keys",
    "verifying_key",
    "write_new_file",
]

PRIVATE_KEY_NAME = "issuer.key"
PUBLIC_KEY_NAME = "issuer.pub"
_PUBLIC_SUFFIXES = (".pem", ".pub")
_PRIVATE_SUFFIX = ".key"  # looked at only to warn: never trusted
_PRIVATE_MARK = b"PRIVATE KEY"  # PKCS#8, "EC PRIVATE KEY", "OPENSSH PRIVATE KEY", "ENCRYPTED PRIVATE KEY"
_MAX_PEM_BYTES = 64 * 1024

_log = logging.getLogger(__name__)
_warned: set[Path] = set()  # private keys already warned of by this process


def fingerprint(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def load_trusted_keys(path: str | None) -> dict[str, Ed25519PublicKey]:
    """The trusted issuer keys by fingerprint; `LicenceInvalid(NO_ISSUER_KEY)` when there are none."""
    if not path:
        _no_issuer_key("GALAHAD_LICENCE_ISSUER_KEY is not set; set it to the issuer's public key "
                       "(issuer.pub) or a folder of them")
    keys: dict[str, Ed25519PublicKey] = {}
    problems = []
    for file in _key_files(path):
        try:
            key = _read_public_key(file)
        except LicenceInvalid as exc:
            problems.append(exc.detail)
            continue
        keys[fingerprint(key)] = key
    if not keys:
        found = "; ".join(problems) if problems else f"no *.pem or *.pub file in {path}"
        _no_issuer_key(f"no usable issuer public key at {path} ({found}); point GALAHAD_LICENCE_ISSUER_KEY "
                       "at the issuer.pub the licence issuer gave you")
    return keys


def _key_files(path: str) -> list[Path]:
    """The file at `path`, or the `*.pem` and `*.pub` files of the folder at `path` (warning of any
    private key among its `*.key` files)."""
    where = Path(path)
    try:
        if not where.is_dir():
            return [where]
        entries = sorted(where.iterdir())
    except (OSError, ValueError) as exc:  # ValueError: a path holding a NUL
        reason = getattr(exc, "strerror", None) or str(exc)
        _no_issuer_key(f"the issuer key path {path!r} cannot be read ({reason}); make it readable")
    for file in entries:
        if file.suffix == _PRIVATE_SUFFIX:
            _warn_if_private(file)
    return [file for file in entries if file.suffix in _PUBLIC_SUFFIXES]


def _read_public_key(file: Path) -> Ed25519PublicKey:
    try:
        pem = read_regular(file, _MAX_PEM_BYTES)
    except NotARegularFile as exc:
        _no_issuer_key(str(exc))
    except (OSError, ValueError) as exc:
        _no_issuer_key(f"{file} cannot be read ({getattr(exc, 'strerror', None) or exc})")
    if _PRIVATE_MARK in pem:
        _warn_private(file)
        _no_issuer_key(f"{file} is a private key: servers need only the public key (issuer.pub); "
                       "keep the private key with the issuer")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm):
        _no_issuer_key(f"{file} is not a PEM public key")
    if not isinstance(key, Ed25519PublicKey):
        _no_issuer_key(f"{file} is not an Ed25519 key")
    return key


def _warn_if_private(file: Path) -> None:
    try:
        content = read_regular(file, _MAX_PEM_BYTES)
    except (OSError, ValueError):
        return  # unreadable, or not a regular file: nothing to warn of
    if _PRIVATE_MARK in content:
        _warn_private(file)


def _warn_private(file: Path) -> None:
    if file in _warned:
        return
    _warned.add(file)
    _log.warning("[galahad] an issuer PRIVATE key is on this server: %s; remove it, servers need only the "
                 ".pub (keep the private key offline, with the issuer)", file)


def verifying_key(licence: SignedLicence, trusted: dict[str, Ed25519PublicKey]) -> str:
    """The fingerprint of the trusted key whose signature `licence` carries.

    `LicenceInvalid(BAD_SIGNATURE)` when the payload claims a trusted issuer but the signature does
    not match (tampered or damaged); `LicenceInvalid(UNKNOWN_ISSUER)` when no trusted key signed it.
    """
    for name, key in trusted.items():
        try:
            key.verify(licence.signature, licence.payload)
        except InvalidSignature:
            continue
        return name
    claimed = licence.claimed_issuer()
    if claimed in trusted:
        raise LicenceInvalid(RefusalReason.BAD_SIGNATURE,
                             f"its signature does not match its content (issuer {claimed}): the file was "
                             "changed or damaged after it was issued; restore the file as issued")
    raise LicenceInvalid(RefusalReason.UNKNOWN_ISSUER,
                         f"it was signed by issuer {claimed or 'unknown'}, which is not among the trusted "
                         f"issuer keys ({', '.join(sorted(trusted))}); install that issuer's public key in "
                         "GALAHAD_LICENCE_ISSUER_KEY if you trust it, or get a licence from a trusted issuer")


def generate_issuer(folder: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Create `folder`/issuer.key (PEM, 0600) and issuer.pub (PEM); never replaces either.

    Returns both paths and the fingerprint. `FileExistsError` when either file exists;
    `NotADirectoryError` when `folder` is an existing file.
    """
    where = Path(folder)
    if where.exists() and not where.is_dir():
        raise NotADirectoryError(f"{where} is an existing file, and keygen --out takes a folder (made if "
                                 "absent) to hold issuer.key and issuer.pub; choose a folder")
    private_path, public_path = where / PRIVATE_KEY_NAME, where / PUBLIC_KEY_NAME
    for path in (private_path, public_path):
        if path.exists():
            raise FileExistsError(f"{path} exists; keygen never replaces an issuer key (choose another --out)")
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    write_new_file(private_path, private_pem, 0o600)
    write_new_file(public_path, public_pem, 0o644)
    return private_path, public_path, fingerprint(key.public_key())


def load_issuer_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The issuer's private key from a PEM file; `ValueError` naming the file when it is not one,
    `OSError` when it cannot be read (`NotARegularFile`: a FIFO, a folder...)."""
    try:
        pem = read_regular(path, _MAX_PEM_BYTES)
    except NotARegularFile as exc:
        raise ValueError(f"{exc}; use the issuer.key made by keygen") from exc
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError as exc:
        raise ValueError(f"{path} is an encrypted private key; galahad-licence reads unencrypted PEM") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"{path} is not a PEM private key (use the issuer.key made by keygen)") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key (use the issuer.key made by keygen)")
    return key


def issue_licence(key: Ed25519PrivateKey, licensee: str, points: int, issued: dt.date,
                  days: int) -> SignedLicence:
    """A licence for `points` GPU ranks, valid from `issued` for `days` days, signed by `key`."""
    try:
        expires = issued + dt.timedelta(days=days)
    except OverflowError:
        raise ValueError(f"{days} days from {issued} is past the last date a licence can hold") from None
    terms = LicenceTerms(licensee, points, issued, expires, fingerprint(key.public_key()))
    payload = terms.payload()
    LicenceTerms.from_payload(payload)  # refuse to sign what a server would refuse to read
    return SignedLicence(payload, key.sign(payload))


def write_new_file(path: str | os.PathLike[str], data: bytes, mode: int) -> None:
    """Write `data` to a new file `path` atomically; `FileExistsError` if `path` exists (never replaced)."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = _create_temp(temp, target, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, target)  # atomic, and fails when the name is taken
        except FileExistsError:
            raise FileExistsError(f"{target} exists; it is never replaced (remove it or choose another name)") from None
    finally:
        temp.unlink(missing_ok=True)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _create_temp(temp: Path, target: Path, mode: int) -> int:
    """Open the temp file for `target`; an error names `target` and its folder, never the temp name."""
    folder = target.parent
    try:
        return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    except FileNotFoundError:
        raise FileNotFoundError(f"cannot write {target}: the folder {folder} does not exist; "
                                f"create it first (mkdir -p {folder}) or choose another path") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"cannot write {target}: {folder} is not a folder; choose a path "
                                 "inside a folder") from None
    except PermissionError:
        raise PermissionError(f"cannot write {target}: no permission to create files in {folder}; "
                              "choose a folder you can write to") from None
    except OSError as exc:
        raise OSError(f"cannot write {target} in {folder} ({exc.strerror}); choose another path") from None


def _no_issuer_key(detail: str) -> NoReturn:
    raise LicenceInvalid(RefusalReason.NO_ISSUER_KEY, detail)
