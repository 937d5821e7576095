"""Where encryption keys come from: a key file or a key command, read once into a `Keyring`.

Key text (the file's content, or the command's standard output): the first key line is the
current key (it seals and opens), the following key lines are retired keys (they open only).
A key line is 64 hexadecimal digits (32 bytes). Blank lines and `#` comments are allowed. A key
whose bytes are all the same (64 zeros, a placeholder) is refused wherever it stands: it is no
secret. No message, log line or repr ever holds key material: keys are named by their 8-byte id.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import pwd
import re
import secrets
import shlex
import signal
import stat
import subprocess
import threading
import time

import attrs

from galahad.domain.error import ConfigError, KeyRefused
from galahad.domain.secret import KEY_BYTES, SecretKey
from galahad.adapters.posix.private_folder import fsync_folder, make_private_folders
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular_with_stat

__all__ = [
    "KEY_COMMAND_TIMEOUT_S",
    "KeyCommandProvider",
    "KeyFileProvider",
    "Keyring",
    "command_label",
    "load_keyring",
    "parse_key_text",
]

_log = logging.getLogger(__name__)

KEY_COMMAND_TIMEOUT_S = 10.0
_POLL_S = 0.1  # how often a running key command is looked at
_ORPHAN_GRACE_S = 1.0  # a command that exited: how long its output may stay open (a background child)
_HEX_DIGITS = 2 * KEY_BYTES
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # NAME=value before a shell command's program
_EMPTY_FILE_WAIT_S = 1.0  # a key file another process is creating right now (no-link fallback)
_MAX_KEY_FILE_BYTES = 1 << 20


@attrs.frozen(repr=False)
class Keyring:
    """The current key (seals and opens) and retired keys (open only). Implements `KeyProvider`."""

    _current: SecretKey
    _retired: tuple[SecretKey, ...] = ()
    source: str = ""

    def current(self) -> SecretKey:
        return self._current

    def by_id(self, key_id: bytes) -> SecretKey | None:
        for key in (self._current, *self._retired):
            if key.key_id == key_id:
                return key
        return None

    @property
    def retired(self) -> tuple[SecretKey, ...]:
        return self._retired

    def __repr__(self) -> str:
        retired = ", ".join(k.key_id.hex() for k in self._retired)
        return f"Keyring(current={self._current.key_id.hex()}, retired=[{retired}], source={self.source!r})"


def parse_key_text(text: str, source: str) -> Keyring:
    """The keyring a key text holds; `KeyRefused` naming `source` and the line when malformed or a
    placeholder (every byte the same)."""
    keys: list[SecretKey] = []
    for number, line in enumerate(text.splitlines(), start=1):
        word = line.split("#", 1)[0].strip()
        if not word:
            continue
        problem = _key_line_problem(word)
        if problem:
            raise KeyRefused(
                f"{source}: line {number} is not a key ({problem}); each key line must be "
                f"{_HEX_DIGITS} hexadecimal digits (generate one with: openssl rand -hex {KEY_BYTES})"
            )
        material = bytes.fromhex(word)
        if len(set(material)) == 1:
            what = "all zeros" if material[0] == 0 else "one byte repeated"
            raise KeyRefused(
                f"{source}: line {number} is not a usable key ({what}: a placeholder anyone can "
                f"guess); replace it with a random key (generate one with: openssl rand -hex {KEY_BYTES})"
            )
        key = SecretKey(material)
        if all(key.key_id != k.key_id for k in keys):
            keys.append(key)
    if not keys:
        raise KeyRefused(
            f"{source}: no key in it (empty, or only comments); put {_HEX_DIGITS} hexadecimal digits "
            f"on the first line (generate them with: openssl rand -hex {KEY_BYTES})"
        )
    return Keyring(keys[0], tuple(keys[1:]), source)


def _key_line_problem(word: str) -> str:
    if len(word) != _HEX_DIGITS:
        return f"{len(word)} characters, not {_HEX_DIGITS}"
    try:
        bytes.fromhex(word)
    except ValueError:
        return "not hexadecimal"
    return ""


class _LazyKeyring:
    """Loads a keyring once, on first use, and keeps it (thread-safe)."""

    def __init__(self) -> None:
        self._keyring: Keyring | None = None
        self._lock = threading.Lock()

    def load(self) -> Keyring:
        with self._lock:
            if self._keyring is None:
                self._keyring = self._read()
            return self._keyring

    def current(self) -> SecretKey:
        return self.load().current()

    def by_id(self, key_id: bytes) -> SecretKey | None:
        return self.load().by_id(key_id)

    def _read(self) -> Keyring:
        raise NotImplementedError


class KeyFileProvider(_LazyKeyring):
    """Keys from a key file (`GALAHAD_KEY_FILE`), read once on first use.

    When the file is absent and `create` is true, it is created with a fresh random key, mode
    0600 (and its missing folders 0700), atomically and without ever replacing a file another
    process created first: that process's key wins and is read back. A file that is group- or
    world-accessible, owned by another user than the one this process runs as (root included:
    its owner can read and replace the key), unreadable or malformed is refused (`KeyRefused`
    naming the file and the fix).
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.create = create

    def __repr__(self) -> str:
        return f"KeyFileProvider({self.path!r})"

    def _read(self) -> Keyring:
        if "\x00" in self.path:
            raise KeyRefused(f"key file {self.path!r}: a path cannot hold a NUL character; fix GALAHAD_KEY_FILE")
        if self.create and not os.path.lexists(self.path):
            if _create_key_file(self.path):
                _log.info("[galahad] created a new encryption key file %s (mode 0600)", self.path)
        return parse_key_text(_read_private_text(self.path), f"key file {self.path}")


def _read_private_text(path: str) -> str:
    deadline = time.monotonic() + _EMPTY_FILE_WAIT_S
    while True:
        try:
            raw, info = read_regular_with_stat(path, _MAX_KEY_FILE_BYTES)  # a FIFO never blocks
        except FileNotFoundError as exc:
            raise KeyRefused(
                f"key file {path} does not exist; create it (`openssl rand -hex {KEY_BYTES} > {path}; "
                f"chmod 600 {path}`) or let Galahad create it"
            ) from exc
        except NotARegularFile as exc:
            raise KeyRefused(f"key file {exc}; point GALAHAD_KEY_FILE at a key file") from exc
        except PermissionError as exc:
            raise KeyRefused(f"key file {path} cannot be read ({exc.strerror}); make it readable by "
                             "the user running the server (and by nobody else: chmod 600)") from exc
        except OSError as exc:
            raise KeyRefused(f"key file {path} cannot be read ({exc.strerror}); check the disk and "
                             "the file's permissions") from exc
        _check_private(path, info, len(raw))
        if raw or time.monotonic() > deadline or time.time() - info.st_mtime > _EMPTY_FILE_WAIT_S:
            break
        time.sleep(0.02)  # just created by a process that could not create it atomically
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise KeyRefused(f"key file {path} is not text (a key line is {_HEX_DIGITS} hexadecimal "
                         "digits); replace it with a key file") from exc


def _check_private(path: str, info: os.stat_result, size: int) -> None:
    if info.st_mode & 0o077:
        raise KeyRefused(
            f"key file {path} is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"anyone who can read it can read the cache: run `chmod 600 {path}`"
        )
    user = os.geteuid()
    if info.st_uid != user:
        raise KeyRefused(
            f"key file {path} belongs to {_user_name(info.st_uid)}, not to {_user_name(user)} that "
            f"runs this process; its owner can read and replace the key: give it to this user "
            f"(`chown {_chown_name(user)} {path}`, as root) or run as its owner"
        )
    if size > _MAX_KEY_FILE_BYTES:
        raise KeyRefused(f"key file {path} is over 1 MiB: not a key file; point GALAHAD_KEY_FILE at "
                         "the key file")


def _user_name(uid: int) -> str:
    """`uid 1000 (vllm)`, or `uid 1000` when the user has no name here."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _chown_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _create_key_file(path: str) -> bool:
    """Write a fresh key to `path` unless it exists; True when this call created it."""
    folder = os.path.dirname(os.path.abspath(path))
    text = (f"# Galahad encryption key. The first key line seals and opens; later lines (retired "
            f"keys) only open.\n{secrets.token_hex(KEY_BYTES)}\n").encode("ascii")
    temp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        make_private_folders(folder)
        _write_new_private_file(temp, text)
        created = _publish_without_replacing(temp, path, text)
        fsync_folder(folder)
        return created
    except OSError as exc:
        raise KeyRefused(f"key file {path} is absent and cannot be created ({exc.strerror}); create it "
                         f"yourself (`openssl rand -hex {KEY_BYTES} > {path}; chmod 600 {path}`) "
                         "or point GALAHAD_KEY_FILE at a writable folder") from exc
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass  # never created, or already gone: nothing to clean


def _publish_without_replacing(temp: str, path: str, text: bytes) -> bool:
    """Give the complete temp file the name `path` only if no file has that name (no clobber)."""
    try:
        os.link(temp, path)  # atomic and exclusive: fails with EEXIST when another process won
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    # No hard links on this filesystem: exclusive create of the final name; a reader that finds
    # it still empty waits for it (_read_private_text).
    try:
        _write_new_private_file(path, text)
    except FileExistsError:
        return False
    return True


def _write_new_private_file(path: str, text: bytes) -> None:
    """Create `path` (never an existing one: `FileExistsError`), mode 0600 whatever the umask,
    holding `text`, durable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        _write_all(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class KeyCommandProvider(_LazyKeyring):
    """Keys from a shell command (`GALAHAD_KEY_COMMAND`) whose standard output is the key text.

    Run once, on first use, with a timeout. A non-zero exit, a timeout or malformed output is
    refused (`KeyRefused` naming the command's program and the problem, never its arguments or
    its output: either may hold the key or a token for the key manager).
    """

    def __init__(self, command: str, *, timeout_s: float = KEY_COMMAND_TIMEOUT_S) -> None:
        super().__init__()
        self.command = command
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"KeyCommandProvider({command_label(self.command)})"

    def _read(self) -> Keyring:
        source = f"key command {command_label(self.command)}"
        stdout = _run_key_command(self.command, self.timeout_s, source)
        try:
            text = stdout.decode("ascii")
        except UnicodeDecodeError as exc:
            raise KeyRefused(f"{source} printed something that is not text; it must print "
                             f"{_HEX_DIGITS} hexadecimal digits (the current key), then any "
                             "retired keys, one a line") from exc
        return parse_key_text(text, source)


def command_label(command: str) -> str:
    """How messages name a key command: its program only (`vault …`), never its arguments or the
    variables set before it, which may hold a secret (`VAULT_TOKEN=... vault read ...`,
    `echo <key>`); the whole command is in the operator's own GALAHAD_KEY_COMMAND."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unclosed quote: the shell will say so when it runs
        words = command.split()
    words = list(itertools.dropwhile(lambda w: _ASSIGNMENT.match(w) is not None, words))
    if not words:
        return "`(no program)`"
    program = os.path.basename(words[0].rstrip(";&|")) or words[0]
    return f"`{program} …`" if len(words) > 1 or ";" in words[0] else f"`{program}`"


def _run_key_command(command: str, timeout_s: float, source: str) -> bytes:
    try:
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except (OSError, ValueError) as exc:  # ValueError: a command holding a NUL
        reason = getattr(exc, "strerror", None) or str(exc)
        raise KeyRefused(f"{source} could not be started ({reason}); check GALAHAD_KEY_COMMAND") from exc
    try:
        stdout, stderr = _output_when_done(proc, timeout_s, source)
    except KeyRefused:
        raise
    except BaseException:  # Ctrl-C while it runs: it is in its own session, so no one else would stop it
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        said = stderr.decode("utf-8", "replace").strip().splitlines()
        tail = f": {said[-1][:200]}" if said else ""
        raise KeyRefused(f"{source} failed (exit status {proc.returncode}){tail}; run it by hand "
                         "as the server's user to see why")
    return stdout


def _output_when_done(proc: subprocess.Popen[bytes], timeout_s: float, source: str) -> tuple[bytes, bytes]:
    """The command's output once it has exited and its output is closed. A command that exited
    while something it started in the background still holds its output open (an agent it
    launched) is taken as done after `_ORPHAN_GRACE_S`: what it printed is read, the pipes closed,
    the background process left alone. Past `timeout_s` the command and its children are killed."""
    deadline = time.monotonic() + timeout_s
    exited_at: float | None = None
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as exc:
            now = time.monotonic()
            if proc.poll() is not None:
                exited_at = now if exited_at is None else exited_at
                if now - exited_at >= _ORPHAN_GRACE_S:
                    _log.info("[galahad] %s exited but left a process holding its output open; read "
                              "what it printed and went on", source)
                    _close_pipes(proc)
                    return exc.stdout or b"", exc.stderr or b""
            if now >= deadline:
                _kill_group(proc)
                raise KeyRefused(f"{source} did not finish within {timeout_s:g} s; make it print the key "
                                 "sooner (is it waiting for input or a network?)") from exc


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the shell and whatever it started
    except OSError:
        proc.kill()
    proc.communicate()


def load_keyring(key_file: str | None = None, key_command: str | None = None) -> Keyring | None:
    """The keyring configured by `GALAHAD_KEY_FILE` or `GALAHAD_KEY_COMMAND`; None when neither is
    (no encryption). `KeyRefused` when the configured source cannot give a key; `ConfigError` when both
    are set."""
    if key_file and key_command:
        raise ConfigError(
            "GALAHAD_KEY_FILE and GALAHAD_KEY_COMMAND are both set; set one (the key file, or the "
            "command that prints the key)"
        )
    if key_file:
        return KeyFileProvider(key_file).load()
    if key_command:
        return KeyCommandProvider(key_command).load()
    return None
