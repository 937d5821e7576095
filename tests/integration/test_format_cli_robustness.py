"""`galahad-format` on a store a server is changing, or one someone tampered with: no traceback,
no hang, and each problem said as the server would say it (docs/format.md, docs/store.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_format_cli import KEYS, _console, _path, _run, store  # noqa: F401  (store: the fixture)

import galahad.cli.format as cli
from galahad.adapters.fs import layout

_NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


def _as_plain_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """`galahad-format` without root's right to read any folder: as root, through setpriv (skipped
    where that cannot drop it); as another user, as it is."""
    if os.geteuid() != 0:
        return _console(*argv)
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a folder unreadable to ourselves")
    probe = subprocess.run([*_NO_OVERRIDE, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop dac_override here: {probe.stderr.decode().strip()}")
    return subprocess.run([*_NO_OVERRIDE, sys.executable, "-m", "galahad.cli.format", *argv], capture_output=True,
                          text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_KEY_")})


def _bad_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("BAD")]


# ---------------------------------------------------------------- parts that are not regular files


@pytest.mark.parametrize("command", ["verify", "stats"])
def test_a_fifo_at_a_parts_name_is_reported_not_waited_on(store: Path, command: str) -> None:
    fifo = _path(store, KEYS[1], 0)
    fifo.unlink()
    os.mkfifo(fifo)
    done = _console(command, "--json", str(store))  # without the fix: killed by the timeout
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    if command == "verify":
        assert done.returncode == 1
        assert {"file": str(fifo), "reason": "not a regular file (a FIFO) (NotAFile)", "class": "NotAFile"} \
            in report["bad"]
        assert report["good"] == 7
    else:
        assert done.returncode == 0 and report["totals"]["unreadable_headers"] == 1


def test_a_fifo_at_a_markers_name_is_reported_not_waited_on(store: Path) -> None:
    marker = _path(store, KEYS[1], 0).parent / layout.marker_name(KEYS[1].hex)
    marker.unlink()
    os.mkfifo(marker)
    done = _console("verify", "--json", str(store))  # read with the store's own reader: never waits
    assert "Traceback" not in done.stderr and done.returncode == 1
    assert any(b["file"] == str(marker) and "commit marker is not a regular file (a FIFO)" in b["reason"]
               for b in json.loads(done.stdout)["bad"])


def test_dump_of_a_fifo_says_so_and_returns(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.blk"
    os.mkfifo(fifo)
    done = _console("dump", "--verify", str(fifo))
    assert done.returncode == 2  # like a folder: the path named is no file
    assert done.stderr.strip() == f"galahad-format: {fifo}: not a regular file (a FIFO)"


def test_dump_follows_a_link_the_user_names(store: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "link.blk"
    link.symlink_to(_path(store, KEYS[0], 1))
    code, out, _ = _run(capsys, "dump", "--verify", str(link))
    assert code == 0 and "OK: every frame verified" in out


def test_a_link_at_a_parts_name_is_not_followed(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server never follows a link inside the store, even to a good part: neither does verify."""
    target, good_copy = _path(store, KEYS[2], 1), store.parent / "elsewhere.blk"
    shutil.move(target, good_copy)
    target.symlink_to(good_copy)
    dangling = _path(store, KEYS[3], 0)
    dangling.unlink()
    dangling.symlink_to(store / "nothing-here")
    code, out, err = _run(capsys, "verify", str(store))
    assert code == 1, out + err
    assert f"BAD          {target}: not a regular file (a symbolic link) (NotAFile)" in out
    assert f"BAD          {dangling}: not a regular file (a symbolic link) (NotAFile)" in out
    assert "8 part file(s) checked: 6 good, 2 bad" in out


def test_stats_counts_a_dangling_link_at_a_parts_name_as_unreadable(store: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dangling = _path(store, KEYS[3], 0)
    dangling.unlink()
    dangling.symlink_to(store / "nothing-here")
    code, out, _ = _run(capsys, "stats", "--json", str(store))  # without the fix: FileNotFoundError from stat()
    totals = json.loads(out)["totals"]
    assert code == 0 and totals["parts"] == 8 and totals["unreadable_headers"] == 1
    code, out, _ = _run(capsys, "stats", str(store))
    assert code == 0 and "parts        8 (" in out and "; 1 with a header that cannot be read" in out


# ---------------------------------------------------------------- a server evicting meanwhile


def _evict_after_the_scan(monkeypatch: pytest.MonkeyPatch, *victims: Path) -> None:
    """Remove `victims` between the scan of the store and the checks of its files, as a running
    server's eviction or quarantine does (at every run: they are put back before each scan)."""
    real_scan, saved = cli.scan_store, {victim: victim.read_bytes() for victim in victims}

    def scan_then_evict(root: Path) -> cli.StoreScan:
        for victim, data in saved.items():
            victim.write_bytes(data)
        scan = real_scan(root)
        for victim in victims:
            victim.unlink()
        return scan

    monkeypatch.setattr(cli, "scan_store", scan_then_evict)


def test_a_part_removed_after_the_scan_is_no_damage(store: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    part = _path(store, KEYS[1], 1)  # its marker stays: the server removes the marker first, then the parts
    _evict_after_the_scan(monkeypatch, part)
    code, out, err = _run(capsys, "verify", str(store))  # without the fix: FileNotFoundError from stat()
    assert code == 0, out + err
    assert f"REMOVED      {part}: removed meanwhile (evicted or quarantined by the server)" in out
    assert "8 part file(s) checked: 7 good, 0 bad, 0 not checked, 0 unsealed, 1 removed meanwhile; 0 problem(s)" in out
    code, out, _ = _run(capsys, "verify", "--json", str(store))
    assert json.loads(out)["removed"] == [str(part)]


def test_an_entry_evicted_after_the_scan_is_no_damage_to_stats(store: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    leaf = _path(store, KEYS[2], 0).parent
    _evict_after_the_scan(monkeypatch, leaf / layout.marker_name(KEYS[2].hex), _path(store, KEYS[2], 0),
                          _path(store, KEYS[2], 1))
    code, out, _ = _run(capsys, "stats", "--json", str(store))
    totals = json.loads(out)["totals"]
    assert code == 0 and totals["parts"] == 6 and totals["unreadable_headers"] == 0


# ---------------------------------------------------------------- folders that cannot be read


@pytest.mark.parametrize("command", ["verify", "stats"])
def test_a_store_folder_that_cannot_be_read_is_one_line_and_status_2(store: Path, command: str) -> None:
    store.chmod(0o000)
    try:
        done = _as_plain_user(command, str(store))
    finally:
        store.chmod(0o700)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    assert f"{store}: cannot read the store folder (Permission denied)" in done.stderr
    assert "as its owner" in done.stderr and f"chmod 700 {store}" in done.stderr


def test_a_sub_folder_that_cannot_be_read_is_a_problem(store: Path) -> None:
    leaf = _path(store, KEYS[0], 0).parent
    leaf.chmod(0o000)
    try:
        verify, verify_json, stats = (_as_plain_user(*argv) for argv in
                                      (("verify", str(store)), ("verify", "--json", str(store)), ("stats", str(store))))
    finally:
        leaf.chmod(0o700)
    assert verify.returncode == 1, verify.stdout + verify.stderr  # without the fix: 0, "6 good"
    assert f"BAD          {leaf}: cannot read the folder (Permission denied): the files in it were not checked" \
        in verify.stdout
    assert "6 part file(s) checked: 6 good, 0 bad" in verify.stdout
    assert [b["class"] for b in json.loads(verify_json.stdout)["bad"]] == ["OSError"]
    assert stats.returncode == 0 and f"PROBLEM      {leaf}: cannot read the folder" in stats.stdout


# ---------------------------------------------------------------- the root and its manifest


@pytest.mark.parametrize("command", ["verify", "stats"])
def test_a_store_folder_others_can_write_to_is_refused_as_the_server_refuses_it(store: Path, command: str) -> None:
    store.chmod(0o777)
    done = _console(command, str(store))
    assert done.returncode == 2, done.stdout
    assert done.stderr == (f"galahad-format: store folder {store} is writable by other users (mode 0777); "
                           f"fix: chmod 700 {store}\n")


@pytest.mark.parametrize("manifest, problem", [
    (b"garbage\n", "it is not JSON"),
    (b'{"format": "galahad-store", "version": 9, "max_bytes": 1, "created": "x"}',
     "version 9 was written by a newer Galahad; this one reads version 1"),
])
def test_a_manifest_the_server_refuses_is_bad(store: Path, capsys: pytest.CaptureFixture[str],
                                              manifest: bytes, problem: str) -> None:
    path = store / layout.MANIFEST_NAME
    path.write_bytes(manifest)
    code, out, _ = _run(capsys, "verify", str(store))
    assert code == 1, out
    assert _bad_lines(out) == [f"BAD          {path}: {path} is not a usable Galahad store manifest ({problem}); "
                               f"move it away or point GALAHAD_CACHE_DIR at another folder (StoreUnavailable)"]
    assert "8 part file(s) checked: 8 good, 0 bad" in out
    code, out, _ = _run(capsys, "stats", str(store))
    assert code == 0 and f"PROBLEM      {path}: " in out


def test_a_fifo_for_a_manifest_is_bad_and_not_waited_on(store: Path) -> None:
    path = store / layout.MANIFEST_NAME
    path.unlink()
    os.mkfifo(path)
    done = _console("verify", str(store))
    assert done.returncode == 1 and f"BAD          {path}: not a regular file (a FIFO) (NotAFile)" in done.stdout


def test_a_store_without_a_manifest_but_with_namespace_folders_is_read(store: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (store / layout.MANIFEST_NAME).unlink()
    code, out, _ = _run(capsys, "verify", str(store))
    assert code == 0 and "8 part file(s) checked: 8 good, 0 bad" in out


# ---------------------------------------------------------------- every refusal names its class


def test_every_bad_line_ends_with_its_class(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short, marker_lost = _path(store, KEYS[0], 1), _path(store, KEYS[1], 0)
    short.write_bytes(short.read_bytes() + b"\0")  # the marker recorded another size
    marker_lost.unlink()
    stray = short.parent / "notes.txt"
    stray.write_text("hello\n")
    code, out, _ = _run(capsys, "verify", str(store))
    bad = _bad_lines(out)
    assert code == 1 and len(bad) == 4, out
    marker = short.parent / layout.marker_name(KEYS[0].hex)
    assert f"BAD          {marker}: committed, but part 1 is 12321 bytes, the marker says 12320 " \
        "(IncompleteEntry)" in bad
    assert any(line.endswith("committed, but part 0 is missing (IncompleteEntry)") for line in bad)
    assert f"BAD          {stray}: not a file of a Galahad store (Misplaced)" in bad
    assert any(line.startswith(f"BAD          {short}: ") and line.endswith("(IntegrityError)") for line in bad)


def test_dump_names_the_class_of_a_file_that_is_not_a_block(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello\n")
    done = _console("dump", str(path))
    assert done.returncode == 1 and done.stderr.startswith(f"galahad-format: {path}: ")
    assert done.stderr.rstrip().endswith("(FormatError)"), done.stderr
