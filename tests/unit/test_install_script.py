"""scripts/install.sh refuses, in one line and before creating anything, a disk without room for
the environment (the CI run that died of ENOSPC halfway through pip). The free space is not
faked: the test asks for more than any disk here has (`GALAHAD_INSTALL_NEED_GIB`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")  # the compiled loop's build: hashed into the stamp
    (tmp_path / "csrc").mkdir()
    shutil.copy(REPO / "csrc" / "readhash.c", tmp_path / "csrc" / "readhash.c")
    return tmp_path


def _run(root: Path, need_gib: str) -> subprocess.CompletedProcess[str]:
    """The script with `PYTHON=false`: past the check it stops at making the environment, so a
    run here never installs anything, even with the check broken."""
    env = {**os.environ, "GALAHAD_INSTALL_NEED_GIB": need_gib, "TMPDIR": str(root), "PYTHON": "false"}
    return subprocess.run(["bash", "scripts/install.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_too_little_disk_is_one_clear_line_and_creates_nothing(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    done = _run(root, "1000000")  # a million GiB: more than this disk has
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("[install] not enough disk space:"), lines[0]
    assert str(root) in lines[0] and "1000000 GiB" in lines[0] and "TMPDIR" in lines[0]
    assert not (root / ".venv").exists()  # nothing half-made


def test_room_enough_goes_on_to_install(tmp_path: Path) -> None:
    """The check passes where there is room: the script goes on to make the environment (and
    stops there: `_run`'s Python cannot)."""
    done = _run(_copy(tmp_path), "0")
    assert done.returncode != 0
    assert "not enough disk space" not in done.stderr
