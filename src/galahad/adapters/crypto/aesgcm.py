"""AES-256-GCM frame sealing: the `Cipher` port with a key.

The rule (normative; spec/format-v1.md states the same):
- per-file key = HKDF-SHA256(master key material, salt = the file's 16-byte salt,
  info = b"galahad-v1-frame-key", length = 32);
- nonce = 4 zero bytes || u64 little-endian frame index (unique per file key, so never reused);
- associated data = the header bytes (`aad`) || u64 little-endian frame index;
- sealed frame = ciphertext || 16-byte tag.

The bulk AES-GCM runs in OpenSSL through cryptography's `AESGCM.encrypt_into`/`decrypt_into`
(about 9-10 GB/s per core here, no allocation per frame; bench/store.py). cryptography 48 and 49
hold the interpreter lock during those calls (a Python thread spinning beside one gets no time),
so frames of several threads take turns: reading them from the store overlaps, decrypting does
not. cryptography 50 releases it (`OPENSSL_OUTSIDE_LOCK`). A frame given in several pieces (it
spans segments) streams through one OpenSSL GCM context (`seal_pieces_into`, about 9 GB/s)
instead of being joined first. Where the installed cryptography lacks the `_into` calls,
pycryptodome does the work (about 1-1.9 GB/s per core, but it releases the interpreter lock, so
it scales across frame threads). HKDF runs in cryptography.
Both give the same bytes as cryptography's `AESGCM`; tests/unit/test_crypto_aesgcm.py checks it
against that oracle.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cryptography
from Crypto.Cipher import AES
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from galahad.domain.error import IntegrityError, KeyRefused
from galahad.domain.secret import SecretKey
from galahad.ports.cipher import KeyProvider

if TYPE_CHECKING:
    from Crypto.Cipher._mode_gcm import GcmMode

__all__ = [
    "AES_GCM_CIPHER_ID",
    "FRAME_KEY_INFO",
    "OPENSSL_OUTSIDE_LOCK",
    "SALT_BYTES",
    "TAG_BYTES",
    "AesGcmCipher",
    "AesGcmCiphers",
    "derive_file_key",
]

AES_GCM_CIPHER_ID = 1
TAG_BYTES = 16
SALT_BYTES = 16
FRAME_KEY_INFO = b"galahad-v1-frame-key"
_MAX_INDEX = 2**64 - 1
_FILE_KEYS_KEPT = 8  # frames of one file share a file key; a few files are in flight at once
_OPENSSL_INTO = hasattr(AESGCM, "decrypt_into") and hasattr(AESGCM, "encrypt_into")


def _openssl_outside_lock(version: str) -> bool:
    """Whether this cryptography version runs AES-GCM (`decrypt_into`, `update_into`) outside
    the interpreter lock: from 50.0 on. Measured on a 2-core machine, 4 MiB frames, one thread
    then two: 50.0.2 gains x1.6-1.7 (`decrypt_into`) and x2.7-3.0
    (`update_into`) from the second thread, 48.0.0 and 49.0.0 x1.07-1.25."""
    try:
        return int(version.split(".")[0]) >= 50
    except ValueError:
        return False


OPENSSL_OUTSIDE_LOCK = _OPENSSL_INTO and _openssl_outside_lock(cryptography.__version__)


class AesGcmCipher:
    """Seals and opens frames with AES-256-GCM under per-file keys derived from one master key.

    Thread-safe: one instance serves every frame of every file sealed under its key. Building one
    is cheap (no key derivation until the first frame). `sealing=False` makes a cipher for a
    retired key: it opens old frames and refuses to seal new ones. `parallel_open=True` opens
    frames with pycryptodome, which releases the interpreter lock, instead of OpenSSL, which
    holds it before cryptography 50: on many cores the frames of a load then decrypt side by side
    (16 cores of a GPU host, cryptography 48: 7.8-9.8 GB/s against 4.5-4.7; on 2 cores OpenSSL
    wins, 6.4 against 2.2 GB/s). With cryptography 50 or
    later OpenSSL runs outside the lock too, and is the faster one per core (`bootstrap` then
    leaves `parallel_open` off).
    """

    cipher_id: int = AES_GCM_CIPHER_ID

    def __init__(self, key: SecretKey, *, sealing: bool = True, parallel_open: bool = False) -> None:
        self._key = key
        self.key_id: bytes = key.key_id
        self._sealing = sealing
        self.parallel_open = parallel_open
        self._file_keys: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        role = "sealing" if self._sealing else "open-only"
        return f"AesGcmCipher(key_id={self.key_id.hex()}, {role})"

    def seal_frame(self, salt: bytes, aad: bytes, index: int, data: bytes | memoryview) -> bytes:
        self._check_sealing(salt, index)
        gcm = self._gcm(salt, aad, index)
        ciphertext = gcm.encrypt(_byte_view(data))  # a new bytes, written outside the lock
        return ciphertext + gcm.digest()  # the one copy; seal_frame_into makes none

    def seal_frame_into(
        self, salt: bytes, aad: bytes, index: int, data: bytes | memoryview, out: memoryview
    ) -> int:
        """`seal_frame` writing into `out` (at least `len(data) + TAG_BYTES` bytes); returns the
        count written. No copy is made under the interpreter lock."""
        self._check_sealing(salt, index)
        data, out = _byte_view(data), _byte_view(out)
        size = len(data)
        if len(out) < size + TAG_BYTES:
            raise ValueError(f"the output holds {len(out)} bytes, the sealed frame {size + TAG_BYTES}")
        if _OPENSSL_INTO:
            self._aead(salt).encrypt_into(_nonce(index), data, _aad(aad, index), out[: size + TAG_BYTES])
            return size + TAG_BYTES
        gcm = self._gcm(salt, aad, index)
        gcm.encrypt(data, output=out[:size])
        out[size : size + TAG_BYTES] = gcm.digest()
        return size + TAG_BYTES

    def seal_pieces_into(
        self, salt: bytes, aad: bytes, index: int, pieces: Sequence[bytes | memoryview], out: memoryview
    ) -> int:
        """`seal_frame_into` of the frame made of `pieces` concatenated, without joining them
        (a frame that spans several segments): several pieces stream through one GCM context."""
        if len(pieces) <= 1:
            return self.seal_frame_into(salt, aad, index, pieces[0] if pieces else b"", out)
        self._check_sealing(salt, index)
        views, out = [_byte_view(p) for p in pieces], _byte_view(out)
        size = sum(len(v) for v in views)
        if len(out) < size + TAG_BYTES:
            raise ValueError(f"the output holds {len(out)} bytes, the sealed frame {size + TAG_BYTES}")
        pos = 0
        if _OPENSSL_INTO:
            mode = modes.GCM(_nonce(index))
            encryptor = Cipher(algorithms.AES(self._file_key(bytes(salt))), mode).encryptor()
            encryptor.authenticate_additional_data(_aad(aad, index))
            for view in views:  # update_into wants 15 bytes of room past the piece: the tag's place
                if encryptor.update_into(view, out[pos : pos + len(view) + TAG_BYTES - 1]) != len(view):
                    raise ValueError("AES-GCM wrote a piece short")  # GCM never buffers: a bug
                pos += len(view)
            encryptor.finalize()
            out[size : size + TAG_BYTES] = encryptor.tag
            return size + TAG_BYTES
        gcm = self._gcm(salt, aad, index)
        for view in views:
            gcm.encrypt(view, output=out[pos : pos + len(view)])
            pos += len(view)
        out[size : size + TAG_BYTES] = gcm.digest()
        return size + TAG_BYTES

    def seal_detached_into(
        self,
        salt: bytes,
        aad: bytes,
        index: int,
        pieces: Sequence[bytes | memoryview],
        out: memoryview,
        tag: memoryview,
    ) -> int:
        """Seal the frame made of `pieces` concatenated with its ciphertext and its tag apart (the
        aligned layout): the ciphertext into the start of `out`, the 16-byte tag into `tag`;
        returns the ciphertext's length. Nothing of `out` past the ciphertext is written."""
        self._check_sealing(salt, index)
        views, out, tag = [_byte_view(p) for p in pieces], _byte_view(out), _byte_view(tag)
        size = sum(len(v) for v in views)
        if len(out) < size or len(tag) != TAG_BYTES:
            raise ValueError(f"the output holds {len(out)} bytes and the tag {len(tag)}, the frame {size} and 16")
        pos = 0
        if _OPENSSL_INTO:
            encryptor = Cipher(algorithms.AES(self._file_key(bytes(salt))), modes.GCM(_nonce(index))).encryptor()
            encryptor.authenticate_additional_data(_aad(aad, index))
            for view in views:
                _update_exactly(encryptor, view, out[pos : pos + len(view)])
                pos += len(view)
            encryptor.finalize()
            tag[:] = encryptor.tag
            return size
        gcm = self._gcm(salt, aad, index)
        for view in views:
            gcm.encrypt(view, output=out[pos : pos + len(view)])
            pos += len(view)
        tag[:] = gcm.digest()
        return size

    def open_detached_into(
        self, salt: bytes, aad: bytes, index: int, data: bytes | memoryview, tag: bytes | memoryview, out: memoryview
    ) -> int:
        """`open_frame_into` of a frame whose ciphertext `data` and 16-byte `tag` lie apart (the
        aligned layout, read from a whole file in memory). Returns the count written; on
        `IntegrityError` those bytes of `out` are zeroed."""
        view, tag, out = _byte_view(data), _byte_view(tag), _byte_view(out)
        if len(salt) != SALT_BYTES or not 0 <= index <= _MAX_INDEX or len(tag) != TAG_BYTES:
            raise IntegrityError(f"frame {index}: not a sealed frame (salt {len(salt)} bytes, tag {len(tag)} bytes)")
        size = len(view)
        if len(out) < size:
            raise ValueError(f"the output buffer holds {len(out)} bytes, frame {index} needs {size}")
        try:
            if _OPENSSL_INTO and not self.parallel_open:
                mode = modes.GCM(_nonce(index), bytes(tag))
                decryptor = Cipher(algorithms.AES(self._file_key(bytes(salt))), mode).decryptor()
                decryptor.authenticate_additional_data(_aad(aad, index))
                _update_exactly(decryptor, view, out[:size])
                decryptor.finalize()
            else:
                gcm = self._gcm(salt, aad, index)
                gcm.decrypt_and_verify(view, bytes(tag), output=out[:size])
        except (ValueError, InvalidTag) as exc:
            out[:size] = bytes(size)  # never leave unverified plaintext behind
            raise self._refusal(index) from exc
        return size

    def _check_sealing(self, salt: bytes, index: int) -> None:
        if not self._sealing:
            raise KeyRefused(
                f"key {self.key_id.hex()} is retired: it opens blocks sealed before, never seals new "
                "ones; seal with the current key (the first key of the key file or command)"
            )
        if len(salt) != SALT_BYTES:
            raise ValueError(f"a file salt is {SALT_BYTES} bytes, not {len(salt)}")
        if not 0 <= index <= _MAX_INDEX:
            raise ValueError(f"a frame index is a u64, not {index}")

    def open_frame(self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview) -> bytes:
        gcm, ciphertext, tag = self._opening(salt, aad, index, sealed)
        try:
            return gcm.decrypt_and_verify(ciphertext, tag)
        except ValueError as exc:  # pycryptodome's "MAC check failed"
            raise self._refusal(index) from exc

    def open_frame_into(
        self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview, out: memoryview
    ) -> int:
        """`open_frame` writing the plaintext into `out` (at least `len(sealed) - TAG_BYTES` bytes,
        e.g. a pinned host buffer); returns the count written. No copy is made under the
        interpreter lock. On `IntegrityError` those bytes of `out` are zeroed."""
        view = self._check_sealed(salt, index, sealed)
        out = _byte_view(out)
        size = len(view) - TAG_BYTES
        if len(out) < size:
            raise ValueError(f"the output buffer holds {len(out)} bytes, frame {index} needs {size}")
        try:
            if _OPENSSL_INTO and not self.parallel_open:
                self._aead(salt).decrypt_into(_nonce(index), view, _aad(aad, index), out[:size])
            else:
                gcm = self._gcm(salt, aad, index)
                gcm.decrypt_and_verify(view[:-TAG_BYTES], view[-TAG_BYTES:], output=out[:size])
        except (ValueError, InvalidTag) as exc:
            out[:size] = bytes(size)  # never leave unverified plaintext behind
            raise self._refusal(index) from exc
        return size

    def _opening(
        self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview
    ) -> tuple[GcmMode, memoryview, memoryview]:
        view = self._check_sealed(salt, index, sealed)
        return self._gcm(salt, aad, index), view[:-TAG_BYTES], view[-TAG_BYTES:]

    def _check_sealed(self, salt: bytes, index: int, sealed: bytes | memoryview) -> memoryview:
        view = _byte_view(sealed)
        if len(salt) != SALT_BYTES or not 0 <= index <= _MAX_INDEX or len(view) < TAG_BYTES:
            raise IntegrityError(
                f"frame {index}: not a sealed frame (salt {len(salt)} bytes, {len(view)} bytes)"
            )
        return view

    def _aead(self, salt: bytes) -> AESGCM:
        return AESGCM(self._file_key(bytes(salt)))

    def _refusal(self, index: int) -> IntegrityError:
        return IntegrityError(
            f"frame {index}: AES-GCM tag mismatch under key {self.key_id.hex()} (damaged or "
            "tampered bytes, or a header that is not the one it was sealed with)"
        )

    def _gcm(self, salt: bytes, aad: bytes, index: int) -> GcmMode:
        gcm = AES.new(self._file_key(bytes(salt)), AES.MODE_GCM, nonce=_nonce(index), mac_len=TAG_BYTES)
        gcm.update(aad)
        gcm.update(index.to_bytes(8, "little"))
        return gcm

    def _file_key(self, salt: bytes) -> bytes:
        with self._lock:
            key = self._file_keys.get(salt)
            if key is not None:
                self._file_keys.move_to_end(salt)
                return key
        key = derive_file_key(self._key, salt)
        with self._lock:
            self._file_keys[salt] = key
            while len(self._file_keys) > _FILE_KEYS_KEPT:
                self._file_keys.popitem(last=False)
        return key


def derive_file_key(key: SecretKey, salt: bytes) -> bytes:
    """HKDF-SHA256(key material, salt, info=FRAME_KEY_INFO) -> the 32-byte key of one file."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=FRAME_KEY_INFO)
    return hkdf.derive(key.material)


def _byte_view(buffer: bytes | bytearray | memoryview) -> memoryview:
    """A flat view of unsigned bytes (len() is then a byte count, whatever the buffer's format)."""
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _update_exactly(context: CipherContext, data: memoryview, out: memoryview) -> None:
    """`context.update(data)` written into `out` (exactly `len(data)` bytes), and nowhere past it.

    `update_into` wants 15 bytes of room past what it writes, so all but the last 15 bytes go
    through it, into `out` itself (GCM is a stream mode: it writes as many bytes as it reads, so
    the room it is lent is not touched, and `out` may be `data`); the last 15 come back as bytes.
    """
    size = len(data)
    head = max(0, size - (TAG_BYTES - 1))
    if head and context.update_into(data[:head], out[:size]) != head:
        raise ValueError("AES-GCM wrote short")  # GCM never buffers: a bug
    if head < size:
        tail = context.update(data[head:])
        if len(tail) != size - head:
            raise ValueError("AES-GCM wrote short")
        out[head:size] = tail


def _aad(aad: bytes, index: int) -> bytes:
    return bytes(aad) + index.to_bytes(8, "little")


def _nonce(index: int) -> bytes:
    return b"\x00\x00\x00\x00" + index.to_bytes(8, "little")


class AesGcmCiphers:
    """One `AesGcmCipher` per key of a key provider, built on first use and kept.

    `for_sealing()` is the cipher of the current key; `for_key_id(key_id)` the cipher that opens
    frames sealed under `key_id` (a retired key's cipher refuses to seal), or None for a key the
    provider does not hold: a miss, never an error.
    """

    def __init__(self, keys: KeyProvider, *, parallel_open: bool = False) -> None:
        self._keys = keys
        self._parallel_open = parallel_open
        self._ciphers: dict[bytes, AesGcmCipher] = {}
        self._lock = threading.Lock()

    def for_sealing(self) -> AesGcmCipher:
        key = self._keys.current()
        return self._cipher(key, sealing=True)

    def for_key_id(self, key_id: bytes) -> AesGcmCipher | None:
        key = self._keys.by_id(bytes(key_id))
        if key is None:
            return None
        return self._cipher(key, sealing=key.key_id == self._keys.current().key_id)

    def _cipher(self, key: SecretKey, *, sealing: bool) -> AesGcmCipher:
        with self._lock:
            cipher = self._ciphers.get(key.key_id)
            if cipher is None:
                cipher = AesGcmCipher(key, sealing=sealing, parallel_open=self._parallel_open)
                self._ciphers[key.key_id] = cipher
            return cipher
