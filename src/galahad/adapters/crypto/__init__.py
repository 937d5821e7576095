"""Encryption at rest: AES-256-GCM frames and the keys they are sealed under."""

from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID, AesGcmCipher, AesGcmCiphers
from galahad.adapters.crypto.key import KeyCommandProvider, KeyFileProvider, Keyring, load_keyring

__all__ = [
    "AES_GCM_CIPHER_ID",
    "AesGcmCipher",
    "AesGcmCiphers",
    "KeyCommandProvider",
    "KeyFileProvider",
    "Keyring",
    "load_keyring",
]
