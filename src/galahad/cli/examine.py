"""Opening and judging one block file, offline (`galahad-format`): a header or a refusal, and
the frames' verdict under the keys given. A file is opened without waiting (a FIFO is reported,
never waited on), and a file found by a store scan is not followed through a link."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Callable
from typing import Any

import attrs

from galahad.domain.error import ConfigError, FormatError, GalahadError, UnknownKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.codec import Expect, read_header, verify_part
from galahad.format.v1 import BlockHeader, Buffer, CipherId
from galahad.ports.cipher import Cipher

__all__ = ["NOT_CHECKED", "PROG", "UNSEALED", "Inspection", "KeySource", "UsageProblem", "examine", "file_kind",
           "load_keys"]

PROG = "galahad-format"

_REMOVED = "removed meanwhile (evicted or quarantined by the server)"
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
_CHECK = Xxh3FrameCheck()
NOT_CHECKED = "not checked: "  # Inspection.frames: no key for a sealed file
UNSEALED = "unsealed: "  # Inspection.frames: every checksum verified, but a server with a key refuses it
UNSEALED_WHY = ("a checksum-only part (cipher 0, not encrypted): a server with a key refuses it, since anyone "
                "who can write the store folder could have planted it")


class UsageProblem(Exception):
    """A problem with what the user asked for (exit status 2), said in one line."""


@attrs.frozen
class Inspection:
    """What one file turned out to be: a header, or a refusal; and the frames' verdict."""

    path: str
    header: BlockHeader | None = None
    error: str = ""  # the error class name when refused, or "Missing", "NotAFile", "OSError"
    reason: str = ""
    frames: str = ""  # "ok", "not checked: ...", "unsealed: ...", or "" when not asked
    removed: bool = False  # found by a store scan, gone when opened: evicted or quarantined meanwhile
    size: int = 0

    @property
    def bad(self) -> bool:
        return bool(self.error)

    @property
    def not_checked(self) -> bool:
        """Sealed under a key that was not given: its frames were not verified."""
        return self.frames.startswith(NOT_CHECKED)

    @property
    def unsealed(self) -> bool:
        """Its checksums verified, but a server holding the key given refuses it (`UNSEALED_WHY`)."""
        return self.frames.startswith(UNSEALED)


# ---------------------------------------------------------------- keys


@attrs.define
class KeySource:
    """The ciphers a reader may use: the keyless check always, AES-GCM for the keys given (a key
    file's, or a key command's)."""

    keyring: Any = None  # an object with by_id(key_id) -> SecretKey | None
    make_cipher: Callable[[Any], Cipher] | None = None
    why_none: str = ("no key: give --key-file PATH or --key-command CMD, or set GALAHAD_KEY_FILE or "
                     "GALAHAD_KEY_COMMAND as the server has it")
    source: str = "the key file"
    _cache: dict[bytes, Cipher] = attrs.Factory(dict)

    def lookup(self, cipher_id: int, key_id: bytes) -> Cipher | None:
        if cipher_id == CipherId.XXH3:
            return _CHECK
        if cipher_id != CipherId.AES_256_GCM or self.keyring is None or self.make_cipher is None:
            return None
        if key_id not in self._cache:
            secret = self.keyring.by_id(key_id)
            if secret is None:
                return None
            self._cache[key_id] = self.make_cipher(secret)
        return self._cache[key_id]

    def missing(self, h: BlockHeader) -> str:
        if self.keyring is None:
            return f"{NOT_CHECKED}{self.why_none}"
        return f"{NOT_CHECKED}key id {h.key_id.hex()} is not in {self.source}"

    def server_refuses(self, h: BlockHeader) -> bool:
        """Whether a server holding these keys refuses a part with header `h` that verified: a
        server with a key accepts sealed parts only (`bootstrap._sealed_only`)."""
        return self.keyring is not None and h.cipher_id == CipherId.XXH3


def load_keys(key_file: str | None, key_command: str | None = None) -> KeySource:
    """The keys for sealed files: `--key-file` or `--key-command`, else the server's own settings
    (`GALAHAD_KEY_FILE` or `GALAHAD_KEY_COMMAND`); none when nothing names a key. A key file is
    never created here."""
    if key_file and key_command:
        raise UsageProblem("--key-file and --key-command are both given; give one")
    if not key_file and not key_command:  # read by the server's own rules: what it refuses, this refuses
        from galahad.config import key_source

        try:
            key_file, key_command = key_source(os.environ)
        except ConfigError as exc:
            raise UsageProblem(f"{exc}; or give --key-file or --key-command") from None
    if not key_file and not key_command:
        return KeySource()
    if key_file and not os.path.exists(key_file):  # a folder or a FIFO exists: the server's reader says what it is
        raise UsageProblem(f"{key_file}: key file not found")
    try:
        from galahad.adapters.crypto.aesgcm import AesGcmCipher
        from galahad.adapters.crypto.key import KeyCommandProvider, KeyFileProvider, command_label
    except ImportError as exc:
        return KeySource(why_none=f"no key: the crypto adapter cannot be imported ({exc})")
    try:
        if key_file:
            keyring = KeyFileProvider(key_file, create=False).load()
        else:
            keyring = KeyCommandProvider(key_command or "").load()
    except GalahadError as exc:
        raise UsageProblem(str(exc)) from None
    source = "the key file" if key_file else f"the keys printed by {command_label(key_command or '')}"
    return KeySource(keyring=keyring, make_cipher=AesGcmCipher, source=source)


# ---------------------------------------------------------------- inspecting one file


class _NotRegular(Exception):
    """What lies where a regular file was expected: its kind, e.g. "a FIFO"."""


def _open_regular(path: str, *, follow: bool) -> tuple[int, int]:
    """(descriptor, size) of the regular file at `path`, opened without waiting (a FIFO is
    reported, never waited on) and, unless `follow`, not through a symbolic link.
    `_NotRegular` for anything else; OSError when it cannot be opened."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise _NotRegular(_KINDS[stat.S_IFLNK]) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotRegular(file_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def file_kind(mode: int) -> str:
    """What a file of this mode is, in words ("a FIFO")."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def examine(path: str, *, verify: bool, keys: KeySource, expect: Expect | None = None,
            scanned: bool = False) -> Inspection:
    """Read `path` (mapped, so only the header is read unless frames are verified) and judge it.

    A file found by scanning a store (`scanned`) is not followed if it is a symbolic link, and
    is `removed` (not bad) if it is gone: the server evicted or quarantined it meanwhile."""
    try:
        fd, size = _open_regular(path, follow=not scanned)
    except _NotRegular as exc:
        return Inspection(path, error="NotAFile", reason=f"not a regular file ({exc})")
    except FileNotFoundError:
        if scanned:
            return Inspection(path, removed=True, reason=_REMOVED)
        return Inspection(path, error="Missing", reason="no such file")
    except OSError as exc:
        return Inspection(path, error="OSError", reason=exc.strerror or str(exc))
    try:
        if size == 0:
            return _judge(path, b"", verify, keys, expect)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            return attrs.evolve(_judge(path, view, verify, keys, expect), size=size)
    except OSError as exc:
        return Inspection(path, error="OSError", reason=exc.strerror or str(exc), size=size)
    finally:
        os.close(fd)


def _judge(path: str, data: Buffer, verify: bool, keys: KeySource, expect: Expect | None) -> Inspection:
    try:
        header = read_header(data)
    except FormatError as exc:
        return Inspection(path, error=type(exc).__name__, reason=str(exc))
    if not verify and expect is None:
        return Inspection(path, header)
    try:
        verify_part(data, expect=expect or Expect(), ciphers=keys.lookup)  # a frame at a time
    except UnknownKey:
        return Inspection(path, header, frames=keys.missing(header))
    except FormatError as exc:
        return Inspection(path, header, error=type(exc).__name__, reason=str(exc))
    if keys.server_refuses(header):
        return Inspection(path, header, frames=UNSEALED + UNSEALED_WHY)
    return Inspection(path, header, frames="ok")
