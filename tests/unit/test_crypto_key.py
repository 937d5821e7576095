"""Key text parsing and the keyring: current and retired keys, refusals that name the source and
never the key material."""

from __future__ import annotations

import os

import pytest

from galahad.adapters.crypto.key import Keyring, load_keyring, parse_key_text
from galahad.domain.error import ConfigError, KeyRefused
from galahad.domain.secret import SecretKey

A, B, C = "a1b2c3d4e5f60718" * 4, "0123456789abcdef" * 4, "FEDCBA9876543210" * 4


def test_the_first_key_line_is_current_and_the_others_are_retired() -> None:
    text = f"# comment\n\n  {A}  \n{B} # retired 2026-10\n\n#{C}\n{C}\n"
    ring = parse_key_text(text, "key file k")
    assert ring.current().material == bytes.fromhex(A)
    assert [k.material for k in ring.retired] == [bytes.fromhex(B), bytes.fromhex(C)]
    assert ring.source == "key file k"


def test_by_id_finds_current_and_retired_keys_and_gives_none_for_others() -> None:
    ring = parse_key_text(f"{A}\n{B}\n", "s")
    for hexkey in (A, B):
        key = SecretKey(bytes.fromhex(hexkey))
        assert ring.by_id(key.key_id) == key
    assert ring.by_id(SecretKey(bytes.fromhex(C)).key_id) is None
    assert ring.by_id(bytes(8)) is None


def test_a_key_listed_twice_is_kept_once() -> None:
    ring = parse_key_text(f"{A}\n{A.upper()}\n{B}\n{B}\n", "s")
    assert len(ring.retired) == 1


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "no key"),
        ("# only a comment\n\n", "no key"),
        (A[:-1], "63 characters"),
        (A + "0", "65 characters"),
        ("g" * 64, "not hexadecimal"),
        (f"{A}\n{B[:10]}\n", "line 2"),
        (f"{A} {B}", "129 characters"),
    ],
)
def test_malformed_key_text_is_refused_naming_the_source_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(KeyRefused) as caught:
        parse_key_text(text, "key file /etc/k")
    message = str(caught.value)
    assert "key file /etc/k" in message and problem in message
    assert "openssl rand -hex 32" in message  # the fix
    for secret in (A, B, A[:-1], B[:10]):
        assert secret not in message


def test_a_refusal_is_a_permission_error_a_caller_would_catch() -> None:
    with pytest.raises(PermissionError):
        parse_key_text("nope", "s")


def test_the_keyring_repr_shows_ids_only() -> None:
    ring = parse_key_text(f"{A}\n{B}\n", "k")
    text = repr(ring) + str(ring)
    assert ring.current().key_id.hex() in text
    assert A not in text and B not in text and bytes.fromhex(A).hex() not in text


def test_no_key_source_means_no_encryption() -> None:
    assert load_keyring() is None
    assert load_keyring(key_file="", key_command="") is None


def test_a_key_file_and_a_key_command_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="GALAHAD_KEY_FILE and GALAHAD_KEY_COMMAND"):
        load_keyring(key_file="/x", key_command="echo")


def test_a_keyring_holds_what_it_was_given() -> None:
    current, old = SecretKey(os.urandom(32)), SecretKey(os.urandom(32))
    ring = Keyring(current, (old,))
    assert ring.current() is current and ring.by_id(old.key_id) is old
