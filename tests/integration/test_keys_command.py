"""The key command, run for real through the shell: its output is the key text; a failure, a
timeout or malformed output is refused naming the command's program and the problem, never its
arguments or its output (either may hold the key, or a token for the key manager)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from galahad.adapters.crypto.key import KeyCommandProvider, load_keyring
from galahad.domain.error import KeyRefused
from galahad.domain.secret import SecretKey

A, B = "c3d4e5f6" * 8, "d4e5f607" * 8


def test_the_command_output_is_the_current_key_then_retired_keys() -> None:
    ring = load_keyring(key_command=f"printf '%s\\n' '# from the vault' {A} {B}")
    assert ring is not None
    assert ring.current() == SecretKey(bytes.fromhex(A))
    assert ring.retired == (SecretKey(bytes.fromhex(B)),)
    assert ring.source.startswith("key command")


def test_the_command_runs_once_however_often_keys_are_asked_for(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    provider = KeyCommandProvider(f"echo run >> {counter}; echo {A}")
    for _ in range(5):
        assert provider.current().key_id == SecretKey(bytes.fromhex(A)).key_id
        assert provider.by_id(bytes(8)) is None
    assert counter.read_text() == "run\n"


def test_a_failing_command_is_refused_with_its_status_and_last_error_line() -> None:
    command = f"echo {A}; echo 'vault: permission denied' >&2; exit 3"
    with pytest.raises(KeyRefused) as caught:
        KeyCommandProvider(command).load()
    message = str(caught.value)
    assert "key command `echo …`" in message and "exit status 3" in message and "vault: permission denied" in message
    assert A not in message  # neither the output nor the arguments are repeated


def test_a_command_that_hangs_is_stopped_and_refused_after_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(KeyRefused, match=r"key command `echo …` did not finish within 0.5 s"):
        KeyCommandProvider(f"echo {A}; sleep 30", timeout_s=0.5).load()
    assert time.monotonic() - started < 10  # its children were killed too: nobody waits for the sleep


@pytest.mark.parametrize(
    ("output", "problem"),
    [("hello", "5 characters"), ("", "no key"), ("z" * 64, "not hexadecimal"), ("'\\377\\376'", "not text")],
)
def test_malformed_output_is_refused_naming_the_command_not_the_output(output: str, problem: str) -> None:
    command = f"printf {output or chr(39) * 2}"
    with pytest.raises(KeyRefused) as caught:
        KeyCommandProvider(command).load()
    message = str(caught.value)
    assert "key command `printf …`" in message and problem in message


@pytest.mark.parametrize(("key", "what"), [("0" * 64, "all zeros"), ("7f" * 32, "one byte repeated")])
def test_a_placeholder_key_printed_by_the_command_is_refused_naming_the_program(key: str, what: str) -> None:
    """A key manager's empty or default secret (64 zeros) is printed like a key, and refused."""
    with pytest.raises(KeyRefused) as caught:
        KeyCommandProvider(f"printf '%s\\n' {key}").load()
    assert str(caught.value) == (f"key command `printf …`: line 1 is not a usable key ({what}: a placeholder "
                                 "anyone can guess); replace it with a random key (generate one with: "
                                 "openssl rand -hex 32)")


def test_a_secret_in_the_command_line_never_reaches_a_message() -> None:
    """A token set before the program, or the key itself as an argument, stays out of the log."""
    for command in (f"VAULT_TOKEN=hvs{A[:20]} galahad-no-such-vault read kv/galahad", f"echo {A}; exit 4"):
        with pytest.raises(KeyRefused) as caught:
            KeyCommandProvider(command).load()
        message = str(caught.value) + repr(KeyCommandProvider(command))
        assert A[:20] not in message and "kv/galahad" not in message
        assert "`galahad-no-such-vault …`" in message or "`echo …`" in message


def test_a_missing_program_is_refused_with_the_shell_reason() -> None:
    with pytest.raises(KeyRefused, match=r"exit status 127.*not found"):
        KeyCommandProvider("galahad-no-such-key-program-xyz").load()


def test_a_command_that_exits_leaving_a_background_process_holding_its_output_is_read_not_timed_out() -> None:
    """`gpg` and key-manager clients may start an agent that keeps the command's output open:
    the command's own exit is what counts, not the agent's."""
    started = time.monotonic()
    ring = KeyCommandProvider(f"echo {A}; sleep 30 &", timeout_s=5).load()
    assert ring.current().material == bytes.fromhex(A)
    assert time.monotonic() - started < 4  # well before the timeout


def test_a_background_process_does_not_hide_a_failing_exit() -> None:
    with pytest.raises(KeyRefused, match="exit status 4"):
        KeyCommandProvider(f"echo {A}; sleep 30 & exit 4", timeout_s=5).load()
