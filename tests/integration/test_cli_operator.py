"""`galahad-format` and `galahad-licence` as an operator drives them, each a real subprocess: a
terminal that cannot print a name, output cut short by `head`, Ctrl-C, a slip on the command line.
Whatever happens: one line on standard error, a documented exit status, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_format_cli import store  # noqa: F401  (store: the fixture)

_STRICT_UTF8 = {"PYTHONIOENCODING": "utf-8"}  # what an en_US.UTF-8 locale gives: no surrogate escapes on stdout


def _tool(module: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("GALAHAD_KEY_FILE", "GALAHAD_KEY_COMMAND", "GALAHAD_LICENCE_ISSUER_KEY")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", f"galahad.cli.{module}", *argv], capture_output=True,
                          text=True, errors="backslashreplace", env=environment, timeout=60)


def _no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def licence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("licence")
    assert _tool("licence", "keygen", "--out", str(folder / "issuer")).returncode == 0
    done = _tool("licence", "issue", "--issuer-key", str(folder / "issuer" / "issuer.key"), "--licensee", "Acme",
                 "--points", "2", "--days", "30", "--out", str(folder / "acme.lic"))
    assert done.returncode == 0, done.stderr
    return folder / "acme.lic"


# ---------------------------------------------------------------- names a terminal cannot print


def test_verify_reports_a_file_whose_name_is_not_utf8_on_a_strict_terminal(store: Path) -> None:
    namespace = next(store.glob("ns-*"))
    stray = os.fsencode(namespace) + b"/caf\xe9.txt"  # a Latin-1 name someone dropped into the store
    open(stray, "wb").close()
    done = _tool("format", "verify", str(store), env=_STRICT_UTF8)
    _no_traceback(done)
    assert done.returncode == 1  # one problem found (Misplaced), not a crash
    assert "caf\\udce9.txt: not a file of a Galahad store (Misplaced)" in done.stdout


def test_show_prints_a_licence_whose_file_name_is_not_utf8_on_a_strict_terminal(licence: Path) -> None:
    renamed = os.fsencode(licence.parent) + b"/acme-m\xfcller.lic"
    os.link(licence, renamed)
    done = _tool("licence", "show", os.fsdecode(renamed), env=_STRICT_UTF8)
    _no_traceback(done)
    assert done.returncode == 0, done.stderr
    assert "licensee: Acme" in done.stdout and "acme-m\\udcfcller.lic" in done.stdout


# ---------------------------------------------------------------- output cut short (| head)


def _piped_to_a_closed_reader(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run the tool with its standard output a pipe whose reader has already gone (`| head -0`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k not in ("GALAHAD_KEY_FILE", "GALAHAD_KEY_COMMAND")}
    try:
        return subprocess.run([sys.executable, "-m", f"galahad.cli.{module}", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", ["verify", "stats", "dump"])
def test_format_output_cut_short_is_quiet_and_141_not_the_status_of_a_problem_found(store: Path,
                                                                                    command: str) -> None:
    target = [str(p) for p in sorted(store.rglob("*.blk"))] if command == "dump" else [str(store)]
    done = _piped_to_a_closed_reader("format", command, *target)
    assert (done.returncode, done.stderr) == (141, "")  # 1 would say a file was refused or a problem found


@pytest.mark.parametrize("command", ["show", "keygen"])
def test_licence_output_cut_short_is_quiet_and_141(licence: Path, tmp_path: Path, command: str) -> None:
    argv = [str(licence)] if command == "show" else ["--out", str(tmp_path / "issuer")]
    done = _piped_to_a_closed_reader("licence", command, *argv)
    assert (done.returncode, done.stderr) == (141, "")
    if command == "keygen":
        assert (tmp_path / "issuer" / "issuer.key").is_file()  # the work was done; only its report was cut


# ---------------------------------------------------------------- --key-file that is there but no file


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_key_file_that_is_a_folder_or_a_fifo_is_named_as_such_not_as_missing(store: Path, tmp_path: Path,
                                                                               kind: str) -> None:
    key = tmp_path / "store.key"
    key.mkdir() if kind == "folder" else os.mkfifo(key)
    done = _tool("format", "verify", "--key-file", str(key), str(store))
    _no_traceback(done)
    assert done.returncode == 2  # an unusable key file: a usage problem
    assert done.stderr.splitlines() == [f"galahad-format: key file {key} is not a regular file "
                                        f"(a {'folder' if kind == 'folder' else 'FIFO'}); point GALAHAD_KEY_FILE "
                                        "at a key file"]
    assert "not found" not in done.stderr


# ---------------------------------------------------------------- Ctrl-C


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie left for init to reap has stopped


def test_ctrl_c_while_the_key_command_runs_stops_it_too(store: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "command.pid"
    command = f"echo $$ > {pid_file}; sleep 60; echo {'11' * 32}"  # a key manager that hangs
    tool = subprocess.Popen([sys.executable, "-m", "galahad.cli.format", "verify", "--key-command", command,
                             str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C as a shell gives it, even where the tests run with SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and tool.poll() is None, "the key command never started"
            time.sleep(0.05)
        shell = int(pid_file.read_text())
        tool.send_signal(signal.SIGINT)  # Ctrl-C reaches the tool's process group, not the command's session
        _, err = tool.communicate(timeout=30)
        assert tool.returncode == 130 and "Traceback" not in err, err
        gone = time.monotonic() + 5  # killed as the tool exits; a busy machine takes a while
        while _alive(shell) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not _alive(shell), "the key command outlived galahad-format"
    finally:
        tool.kill()
        if pid_file.exists() and pid_file.read_text().strip():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # what this test started, if left
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------- an empty path (a variable left unset)


@pytest.mark.parametrize("argv", [["keygen", "--out", ""],
                                  ["issue", "--issuer-key", "{issuer}", "--licensee", "A", "--points", "1",
                                   "--days", "1", "--out", ""],
                                  ["issue", "--issuer-key", "", "--licensee", "A", "--points", "1", "--days", "1",
                                   "--out", "new.lic"],
                                  ["show", ""]])
def test_an_empty_path_is_refused_and_nothing_is_written_in_the_current_folder(licence: Path, tmp_path: Path,
                                                                               argv: list[str]) -> None:
    issuer = licence.parent / "issuer" / "issuer.key"
    done = subprocess.run([sys.executable, "-m", "galahad.cli.licence", *(a.format(issuer=issuer) for a in argv)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    _no_traceback(done)
    assert done.returncode == 2, done  # a malformed command line
    assert done.stderr.splitlines()[-1].endswith("the path is empty (is a shell variable unset?); give a path")
    assert list(tmp_path.iterdir()) == []  # keygen --out "" wrote the issuer's private key here


# ---------------------------------------------------------------- a licensee that is not text


def test_issue_refuses_a_licensee_that_is_not_utf8_and_signs_nothing(licence: Path, tmp_path: Path) -> None:
    out = tmp_path / "muller.lic"
    argv = [sys.executable.encode(), b"-m", b"galahad.cli.licence", b"issue", b"--issuer-key",
            os.fsencode(licence.parent / "issuer" / "issuer.key"), b"--licensee", b"M\xfcller GmbH",  # Latin-1
            b"--points", b"1", b"--days", b"1", b"--out", os.fsencode(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    _no_traceback(done)
    assert done.returncode == 2, done
    assert "the licensee holds the byte 0xfc, which is not UTF-8 text" in done.stderr
    assert not out.exists()  # it signed "M\udcfcller GmbH", a name no UTF-8 reader can hold


# ---------------------------------------------------------------- days beyond reason, a licence born expired


def test_days_beyond_a_hundred_years_are_a_command_line_slip_not_a_failure(licence: Path, tmp_path: Path) -> None:
    issuer = licence.parent / "issuer" / "issuer.key"
    for days in ("36601", "99999999"):  # the second is past the calendar's last date
        done = _tool("licence", "issue", "--issuer-key", str(issuer), "--licensee", "Acme", "--points", "1",
                     "--days", days, "--out", str(tmp_path / f"{days}.lic"))
        _no_traceback(done)
        assert done.returncode == 2 and "more than a hundred years" in done.stderr, done.stderr
        assert not (tmp_path / f"{days}.lic").exists()


def test_a_back_dated_licence_that_has_already_expired_is_signed_with_a_note_saying_so(
        licence: Path, tmp_path: Path) -> None:
    issuer = licence.parent / "issuer" / "issuer.key"
    done = _tool("licence", "issue", "--issuer-key", str(issuer), "--licensee", "Acme", "--points", "1",
                 "--days", "30", "--issued", "2020-01-01", "--out", str(tmp_path / "old.lic"))
    assert done.returncode == 0, done.stderr
    assert "note: this licence expired on 2020-01-31" in done.stderr and "servers refuse it" in done.stderr
    fresh = _tool("licence", "issue", "--issuer-key", str(issuer), "--licensee", "Acme", "--points", "1",
                  "--days", "30", "--out", str(tmp_path / "new.lic"))
    assert fresh.returncode == 0 and "note:" not in fresh.stderr, fresh.stderr


@pytest.mark.parametrize("mark", ["\u202e", "\u2067", "\u200f"])
def test_issue_refuses_a_licensee_holding_a_bidirectional_control_and_signs_nothing(
        licence: Path, tmp_path: Path, mark: str) -> None:
    """A right-to-left override in the name reorders the server's `licence OK: <licensee>` line
    wherever it is shown (a terminal, a log viewer): `Acme<U+202E>reniatnoC` reads `AcmeContainer`."""
    issuer = licence.parent / "issuer" / "issuer.key"
    done = _tool("licence", "issue", "--issuer-key", str(issuer), "--licensee", f"Acme{mark}reniatnoC",
                 "--points", "1", "--days", "30", "--out", str(tmp_path / "bidi.lic"))
    _no_traceback(done)
    assert done.returncode == 2 and f"U+{ord(mark):04X}" in done.stderr, done.stderr
    assert not (tmp_path / "bidi.lic").exists()
    arabic = _tool("licence", "issue", "--issuer-key", str(issuer), "--licensee", "شركة أكمي",
                   "--points", "1", "--days", "30", "--out", str(tmp_path / "arabic.lic"))
    assert arabic.returncode == 0, arabic.stderr  # right-to-left letters themselves are fine
