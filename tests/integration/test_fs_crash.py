"""Crash consistency with real crashes: a writer process killed with SIGKILL at random moments.

The writer (helpers/store_worker.py `crash`) puts and commits multi-part entries whose every part
checks itself, and says on stdout which entries it committed. After each kill the store must open,
every committed entry must read back whole and right (and every entry the writer reported
committed must still be committed), and no file under a final name may be partial. Every fourth
run goes to a second store under a small cap, so kills also cut evictions short.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore, marker
from galahad.adapters.fs.layout import TEMP_PREFIX, parse_name
from galahad.domain.chain import ChainKey
from helpers.store_worker import NAMESPACE, check

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"
CAP = 8 << 20
ROTATE = 25  # runs per store folder: a fresh one then, so the stores (and their checks) stay small


class Campaign:
    """Runs of the writer on two stores (no cap; a small cap), each killed, each checked.

    `seen_from`: the same folder as another node sees it (another mount of a shared filesystem):
    the checks then read the stores through it; the writer writes through `folder`."""

    def __init__(self, folder: Path, seed: int, seen_from: Path | None = None) -> None:
        self.rng = random.Random(seed)
        self.folder = folder
        self.seen_from = seen_from or folder
        self.roots: set[Path] = set()
        self.promised: dict[Path, set[str]] = {}  # reported committed (uncapped, never quarantined)
        self.verified: set[tuple[Path, int, int]] = set()  # (path, inode, size) already read whole
        self.committed_seen = 0

    def run(self, index: int) -> None:
        capped = index % 4 == 3
        root = self.folder / f"{'capped' if capped else 'uncapped'}-{index // ROTATE}"  # bounded growth
        self.roots.add(root)
        promised = self.promised.setdefault(root, set())
        for line in _run_and_kill(root, index, CAP if capped else None, self.rng.uniform(0.0, 0.5)):
            word, keyhex, *_ = line.split() + [""]
            assert len(keyhex) == 64, f"writer said {line!r}"
            if word == "committed" and not capped:
                promised.add(keyhex)
            elif word == "quarantining":
                promised.discard(keyhex)
        self.check(self.seen_from / root.relative_to(self.folder), promised)

    def unverified(self, path: Path) -> tuple[Path, int, int] | None:
        """`path`'s identity if its bytes were not checked yet (a final name's file never changes)."""
        st = path.stat()
        ident = (path, st.st_ino, st.st_size)
        return None if ident in self.verified else ident

    def check(self, root: Path, promised: set[str]) -> None:
        ns_dir = root / f"ns-{NAMESPACE.hex}"
        with FilesystemBlockStore(root, NAMESPACE, rescan_s=None) as store:
            # the scan at open trims a capped store left over its cap by a kill: let it end first
            assert store.wait_indexed(60)
            committed = {key.hex: key for key in store.committed()}
            assert not promised - committed.keys(), "entries reported committed were lost"
            for keyhex, key in committed.items():
                leaf = ns_dir / keyhex[0:2] / keyhex[2:4]
                sizes = marker.decode((leaf / f"{keyhex}.ok").read_bytes())
                assert sizes is not None
                for part in sizes:
                    ident = self.unverified(leaf / f"{keyhex}.p{part}.blk")
                    if ident is not None:
                        data = store.get(key, part)
                        assert data is not None and check(key, part, data), f"{keyhex}.p{part} reads wrong"
                        self.verified.add(ident)
        self.committed_seen += len(committed)
        for path in ns_dir.glob("??/??/*.blk"):
            ident = self.unverified(path)
            if ident is not None:
                parsed = parse_name(path.name)
                assert parsed is not None and parsed[1] is not None
                assert check(ChainKey.from_hex(parsed[0]), parsed[1], path.read_bytes()), f"partial file {path}"
                self.verified.add(ident)
        for path in ns_dir.glob("??/??/*.ok"):
            assert marker.decode(path.read_bytes()) is not None, f"partial marker {path}"

    def check_cleanup(self) -> None:
        """With no grace, a reopen removes every temp file and every part of an uncommitted entry."""
        for root in sorted(self.seen_from / r.relative_to(self.folder) for r in self.roots):
            with FilesystemBlockStore(root, NAMESPACE, stale_grace_s=0, rescan_s=None) as store:
                assert store.wait_indexed(60)
            ns_dir = root / f"ns-{NAMESPACE.hex}"
            assert not [p for p in ns_dir.glob("??/??/*") if p.name.startswith(TEMP_PREFIX)]
            for path in ns_dir.glob("??/??/*.blk"):
                keyhex = path.name.split(".")[0]
                assert (path.parent / f"{keyhex}.ok").exists(), f"uncommitted part {path} survived"


def _run_and_kill(root: Path, seed: int, max_bytes: int | None, delay: float) -> list[str]:
    args = [sys.executable, str(WORKER), "crash", str(root), str(seed)] + ([str(max_bytes)] if max_bytes else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        first = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if first.strip() != "ready":
            proc.kill()
            raise AssertionError(f"writer did not start: {first!r} {proc.communicate()[1]}")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"writer ended by itself ({proc.returncode}): {err}"
    # whole lines only: what follows the last newline is a line the kill cut short
    return out.split("\n")[:-1]


def campaign(folder: Path, kills: int, seen_from: Path | None = None) -> Campaign:
    """`kills` runs of the writer through `folder`, checked through `seen_from` (default: the same)."""
    runs = Campaign(folder, int(os.environ.get("GALAHAD_CRASH_SEED", "20261130")), seen_from)
    for index in range(kills):
        runs.run(index)
    runs.check_cleanup()
    assert runs.committed_seen > 0, "no entry was ever committed: the writer did nothing"
    return runs


def test_committed_entries_survive_20_sigkills_whole(tmp_path: Path) -> None:
    campaign(tmp_path, 20)


@pytest.mark.slow
def test_committed_entries_survive_200_sigkills_whole(tmp_path: Path) -> None:
    campaign(tmp_path, 200)
