"""`galahad-licence` end to end, each command a real subprocess: keygen, issue, show; refusals are
one line on standard error and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from galahad.adapters.licence import EdLicence
from galahad.domain.licence import RefusalReason


def _cli(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None, timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "GALAHAD_LICENCE_ISSUER_KEY"}
    environment.update(env or {})
    command = [*(prefix or []), sys.executable, "-m", "galahad.cli.licence", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout)


def _refused_in_one_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("galahad-licence: error:"), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "issuer"
    done = _cli("keygen", "--out", str(folder))
    assert done.returncode == 0, done.stderr
    return folder


def test_keygen_makes_a_private_key_0600_and_a_public_key(issuer: Path) -> None:
    private, public = issuer / "issuer.key", issuer / "issuer.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(issuer.stat().st_mode) == 0o700
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")


def test_keygen_never_replaces_an_issuer_key(issuer: Path) -> None:
    before = (issuer / "issuer.key").read_bytes()
    _refused_in_one_line(_cli("keygen", "--out", str(issuer)), "issuer.key exists")
    assert (issuer / "issuer.key").read_bytes() == before


def test_issue_then_show_round_trips_and_the_server_side_check_agrees(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "acme.lic"
    done = _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "Acme GmbH", "--points", "8",
                "--days", "365", "--out", str(licence))
    assert done.returncode == 0, done.stderr
    assert "Acme GmbH, 8 points" in done.stdout
    shown = _cli("show", str(licence))
    assert shown.returncode == 0
    assert "licensee: Acme GmbH" in shown.stdout and "points:   8" in shown.stdout
    assert "validity: not checked" in shown.stdout
    checked = _cli("show", str(licence), "--issuer-key-pub", str(issuer / "issuer.pub"), "--ranks", "8")
    assert checked.returncode == 0 and "validity: licence OK: Acme GmbH, 8 points" in checked.stdout
    assert EdLicence(str(licence), str(issuer / "issuer.pub")).check(8).valid


def test_show_checks_against_the_issuer_key_variable_and_exits_1_when_refused(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "small.lic"
    assert _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "Small", "--points", "2",
                "--days", "30", "--out", str(licence)).returncode == 0
    env = {"GALAHAD_LICENCE_ISSUER_KEY": str(issuer)}
    assert _cli("show", str(licence), env=env).returncode == 0
    too_many = _cli("show", str(licence), "--ranks", "4", env=env)
    assert too_many.returncode == 1 and "licence refused (too few points)" in too_many.stdout


def test_an_expired_licence_is_shown_as_expired(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "old.lic"
    assert _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "Old", "--points", "1",
                "--days", "30", "--issued", "2020-01-01", "--out", str(licence)).returncode == 0
    shown = _cli("show", str(licence), "--issuer-key-pub", str(issuer / "issuer.pub"))
    assert shown.returncode == 1 and "licence refused (expired)" in shown.stdout and "2020-01-31" in shown.stdout
    status = EdLicence(str(licence), str(issuer / "issuer.pub")).check(1)
    assert status.reason is RefusalReason.EXPIRED


def test_a_tampered_licence_is_shown_as_a_bad_signature(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "t.lic"
    assert _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "T", "--points", "1",
                "--days", "30", "--out", str(licence)).returncode == 0
    licence.write_text(licence.read_text().replace('"points":1', '"points":9'))
    shown = _cli("show", str(licence), "--issuer-key-pub", str(issuer / "issuer.pub"))
    assert shown.returncode == 1 and "licence refused (bad signature)" in shown.stdout


def test_a_licence_from_another_issuer_is_shown_as_an_unknown_issuer(issuer: Path, tmp_path: Path) -> None:
    other, licence = tmp_path / "other", tmp_path / "o.lic"
    assert _cli("keygen", "--out", str(other)).returncode == 0
    assert _cli("issue", "--issuer-key", str(other / "issuer.key"), "--licensee", "O", "--points", "1",
                "--days", "30", "--out", str(licence)).returncode == 0
    shown = _cli("show", str(licence), "--issuer-key-pub", str(issuer / "issuer.pub"))
    assert shown.returncode == 1 and "licence refused (unknown issuer)" in shown.stdout


def test_issue_never_replaces_a_licence_file(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "a.lic"
    licence.write_text("already here")
    done = _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "A", "--points", "1",
                "--days", "1", "--out", str(licence))
    _refused_in_one_line(done, "a.lic exists")
    assert licence.read_text() == "already here"


@pytest.mark.parametrize("which", ["public", "absent"])
def test_issue_with_a_key_that_is_not_a_private_key_fails_in_one_line(issuer: Path, tmp_path: Path, which: str) -> None:
    key = issuer / "issuer.pub" if which == "public" else tmp_path / "none.key"
    done = _cli("issue", "--issuer-key", str(key), "--licensee", "A", "--points", "1", "--days", "1",
                "--out", str(tmp_path / "x.lic"))
    _refused_in_one_line(done, str(key))
    assert not (tmp_path / "x.lic").exists()


@pytest.mark.parametrize("content", [None, "garbage\n", '{"format":"galahad-licence-v1",\n' + "A" * 86 + "==\n"])
def test_show_of_a_missing_or_malformed_file_fails_in_one_line(tmp_path: Path, content: str | None) -> None:
    licence = tmp_path / "l.lic"
    if content is not None:
        licence.write_text(content)
    _refused_in_one_line(_cli("show", str(licence)), str(licence))


def test_show_of_an_unreadable_file_fails_in_one_line(issuer: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permissions cannot be enforced")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]
    else:
        prefix = []
    licence = tmp_path / "locked.lic"
    assert _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "L", "--points", "1",
                "--days", "30", "--out", str(licence)).returncode == 0
    licence.chmod(0o000)
    _refused_in_one_line(_cli("show", str(licence), prefix=prefix), "cannot be read", str(licence))


@pytest.mark.parametrize(
    "args",
    [["issue", "--licensee", "A"], ["issue", "--issuer-key", "k", "--licensee", "A", "--points", "0", "--days", "1",
                                    "--out", "o"], ["bogus"], []],
)
def test_a_malformed_command_line_exits_2_with_usage(args: list[str]) -> None:
    done = _cli(*args)
    assert done.returncode == 2 and "usage: galahad-licence" in done.stderr and "Traceback" not in done.stderr


def test_the_console_script_is_installed() -> None:
    # beside this interpreter (a venv run without activating it, as scripts/test.sh does), or on PATH
    script = shutil.which("galahad-licence", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                                   os.environ.get("PATH", "")]))
    if script is None:
        pytest.skip("the package is not installed with its console scripts")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "keygen" in done.stdout


def test_keygen_into_an_existing_file_says_it_wants_a_folder(tmp_path: Path) -> None:
    existing = tmp_path / "afile"
    existing.write_text("mine")
    _refused_in_one_line(_cli("keygen", "--out", str(existing)), f"{existing} is an existing file", "folder")
    assert existing.read_text() == "mine"


def test_issue_into_a_missing_folder_names_that_folder_never_a_temp_file(issuer: Path, tmp_path: Path) -> None:
    out = tmp_path / "nodir" / "l.lic"
    done = _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "A", "--points", "1",
                "--days", "1", "--out", str(out))
    _refused_in_one_line(done, f"the folder {tmp_path / 'nodir'} does not exist", "create it")
    assert ".tmp" not in done.stderr and not out.parent.exists()


def test_one_point_and_one_rank_are_said_in_the_singular(issuer: Path, tmp_path: Path) -> None:
    licence = tmp_path / "one.lic"
    done = _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", "One", "--points", "1",
                "--days", "30", "--out", str(licence))
    assert done.returncode == 0 and "One, 1 point, issued" in done.stdout, done
    shown = _cli("show", str(licence), "--issuer-key-pub", str(issuer / "issuer.pub"))
    assert shown.returncode == 0 and "1 rank]" in shown.stdout and "rank(s)" not in shown.stdout


@pytest.mark.parametrize("name", ["Acme\nINFO [galahad] caching ENABLED", "Acme\x1b[2J"])
def test_issue_refuses_a_licensee_with_control_characters(issuer: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "ctl.lic"
    done = _cli("issue", "--issuer-key", str(issuer / "issuer.key"), "--licensee", name, "--points", "1",
                "--days", "1", "--out", str(out))
    assert done.returncode == 2 and "control character" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_show_of_a_fifo_fails_at_once_in_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "l.lic"
    os.mkfifo(fifo)
    _refused_in_one_line(_cli("show", str(fifo), timeout=20), f"{fifo} is not a regular file (a FIFO)")
