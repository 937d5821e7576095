"""A real GlusterFS volume for the shared-store tests, mounted several times: each mount stands for
one node.

Needs root, `glusterd`, `gluster` and `mount.glusterfs` (Debian: glusterfs-server and
glusterfs-client; `.ci/run` installs them where it runs as root) and /dev/fuse. Where any is
missing, the `volume` fixture skips the test, naming what is missing. The volume has one brick in a
temporary folder; `glusterd` is started when it is not running, and left running.

The faults a network filesystem has are real ones: `kill_brick()` SIGKILLs the brick process
(every call on every mount then fails with ENOTCONN), `start_brick()` starts it again (the mounts
reconnect by themselves, within a few seconds), `pause_brick()` SIGSTOPs it (calls that reach it
hang: a stalled server), `unmount()` lazily detaches a mount and `remount()` mounts it again,
`stop_glusterd()` stops the management daemon.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["GlusterVolume", "missing", "volume"]

_TOOLS = ("glusterd", "gluster", "mount.glusterfs")


def missing() -> str | None:
    """Why a GlusterFS volume cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "GlusterFS: needs root (glusterd and FUSE mounts)"
    absent = [tool for tool in _TOOLS if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if absent:
        return f"GlusterFS: {', '.join(absent)} not installed (apt-get install glusterfs-server glusterfs-client)"
    if not os.path.exists("/dev/fuse"):
        return "GlusterFS: /dev/fuse is absent"
    return None


def _run(*args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=check, env=env)


def _gluster(*args: str, check: bool = True, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return _run("gluster", "--mode=script", *args, check=check, timeout=timeout)


def _ensure_glusterd() -> None:
    if _gluster("pool", "list", check=False, timeout=20).returncode == 0:
        return
    _run("glusterd", "--log-level=WARNING")
    deadline = time.monotonic() + 30
    while _gluster("pool", "list", check=False, timeout=20).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("glusterd did not answer within 30 s")
        time.sleep(0.5)


class GlusterVolume:
    """One GlusterFS volume with a brick in a temporary folder, mounted by `mount()`."""

    def __init__(self, base: Path) -> None:
        self.name = f"galahad-{uuid.uuid4().hex[:8]}"
        self.host = socket.gethostname()
        self.base = base
        self.brick = base / "brick"
        self.mounts: list[Path] = []
        self.brick.mkdir(parents=True)
        _gluster("volume", "create", self.name, f"{self.host}:{self.brick}", "force")
        _gluster("volume", "start", self.name)

    def mount(self, name: str | None = None) -> Path:
        """A new mount of the volume (one more node), made 0700 at its top."""
        point = self.base / (name or f"node{len(self.mounts)}")
        point.mkdir(exist_ok=True)
        self._mount(point)
        self.mounts.append(point)
        return point

    def _mount(self, point: Path) -> None:
        _run("mount", "-t", "glusterfs", f"{self.host}:/{self.name}", str(point), timeout=60)
        os.chmod(point, 0o700)

    def unmount(self, point: Path) -> None:
        """Detach a mount (lazily: open descriptors on it keep what they had)."""
        _run("umount", "-l", str(point), check=False)

    def remount(self, point: Path) -> None:
        self._mount(point)

    def _brick_pid(self) -> int | None:
        out = _run("pgrep", "-f", f"glusterfsd.*--volfile-id {self.name}\\.", check=False).stdout.split()
        return int(out[0]) if out else None

    def kill_brick(self) -> None:
        """SIGKILL the brick: every call on every mount fails (ENOTCONN) until `start_brick()`."""
        pid = self._brick_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: self._brick_pid() is None, 10, "the brick to die")

    def start_brick(self) -> None:
        """Start the brick again and wait until every mount answers."""
        deadline = time.monotonic() + 60
        while self._brick_pid() is None:
            _gluster("volume", "start", self.name, "force", check=False)
            if self._brick_pid() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the brick did not start again within 60 s")
                time.sleep(1)
        for point in self.mounts:
            _wait(lambda p=point: _answers(p), 30, f"{point} to answer again")

    def pause_brick(self) -> None:
        """SIGSTOP the brick: calls that reach it hang (a stalled server), until `resume_brick()`."""
        pid = self._brick_pid()
        assert pid is not None, "no brick process"
        os.kill(pid, signal.SIGSTOP)

    def resume_brick(self) -> None:
        pid = self._brick_pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def stop_glusterd(self) -> None:
        """Stop the management daemon (mounted clients and the brick serve on without it)."""
        _run("pkill", "-x", "glusterd", check=False)
        _wait(lambda: _run("pgrep", "-x", "glusterd", check=False).returncode != 0, 10, "glusterd to stop")

    def start_glusterd(self) -> None:
        _ensure_glusterd()

    def close(self) -> None:
        self.resume_brick()
        for point in self.mounts:
            _run("umount", "-l", str(point), check=False)
        _gluster("volume", "stop", self.name, "force", check=False)
        _gluster("volume", "delete", self.name, check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def _answers(point: Path) -> bool:
    try:
        os.lstat(point / f".probe-{uuid.uuid4().hex}")
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _wait(ready: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def volume() -> Iterator[GlusterVolume]:
    """A fresh volume mounted twice (node-a, node-b: two nodes) for one test module; skips where
    GlusterFS cannot run; removed afterwards."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    _ensure_glusterd()
    made = GlusterVolume(Path(tempfile.mkdtemp(prefix="galahad-gluster-")))
    try:
        made.mount("node-a")
        made.mount("node-b")
        yield made
    finally:
        made.close()
