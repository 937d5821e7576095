"""The store's record of keys retired on purpose (`ROOT/galahad-retired-keys`,
`adapters/crypto/retired.py`) against real files and real processes: servers starting together
each keep their ids in it, a record that cannot be read whole is never rewritten from a part of
it, and what a writer killed mid-write left is cleaned up.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import threading
import time
from pathlib import Path

import pytest

from galahad.adapters.crypto import retired
from galahad.adapters.crypto.retired import LOCK_NAME, RECORD_NAME, note_retired_keys

_SERVERS = 16


def _start(folder: str, n: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    barrier.wait()
    note_retired_keys(folder, bytes([0xCC, n]) + bytes(6), [bytes([0xAA, n]) + bytes(6)])


def _ids(path: Path) -> set[str]:
    """The retired ids the record lists (each line: a retired id, then the id that retired it)."""
    return {line.split()[0] for line in path.read_text().splitlines() if line and not line.startswith("#")}


def test_sixteen_servers_starting_at_once_each_keep_their_retired_key_in_the_record(tmp_path: Path) -> None:
    """Each start reads the record, adds its retired ids and renames a new record into place: two
    starts at once used to keep only the last rename, losing the other's ids (then its old
    key's entries were kept for good, never replaced)."""
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        folder = tmp_path / f"store{round_}"
        folder.mkdir(mode=0o700)
        barrier = ctx.Barrier(_SERVERS)
        starts = [ctx.Process(target=_start, args=(str(folder), n, barrier)) for n in range(_SERVERS)]
        for p in starts:
            p.start()
        for p in starts:
            p.join(60)
            assert p.exitcode == 0
        assert _ids(folder / RECORD_NAME) == {(bytes([0xAA, n]) + bytes(6)).hex() for n in range(_SERVERS)}
        assert sorted(os.listdir(folder)) == [RECORD_NAME, LOCK_NAME]  # no temporary file left behind


def _hold_lock(folder: Path) -> int:
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a lock of another open file: this process's own start waits for it
    return fd


def test_a_start_waits_for_the_lock_as_long_as_other_servers_keep_taking_turns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fleet starting at once on a network filesystem queues for the lock for seconds (12
    servers on two GlusterFS mounts, test_fs_shared.py: more than 5 s under load). A start that
    gave up after a fixed wait would rewrite the record unlocked and lose ids: it waits while the
    record keeps changing."""
    monkeypatch.setattr(retired, "_LOCK_WAIT_S", 0.3)
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    fd = _hold_lock(folder)
    others = [bytes([0xDD, n]) + bytes(6) for n in range(8)]

    def other_servers() -> None:  # each takes its turn, 0.15 s apart: 1.2 s in all
        for n, old in enumerate(others):
            time.sleep(0.15)
            temp = folder / f"turn{n}"
            temp.write_text("".join(f"{o.hex()}\n" for o in others[: n + 1]))
            os.replace(temp, folder / RECORD_NAME)
        os.close(fd)

    turns = threading.Thread(target=other_servers)
    started = time.monotonic()
    turns.start()
    with caplog.at_level(logging.WARNING, logger="galahad"):
        note_retired_keys(str(folder), bytes([0xCC, 1]) + bytes(6), [bytes([0xAA, 1]) + bytes(6)])
    turns.join()
    assert time.monotonic() - started >= 1.2  # it waited for the last turn
    assert not [r for r in caplog.records if "stayed locked" in r.getMessage()]
    assert _ids(folder / RECORD_NAME) == {o.hex() for o in others} | {(bytes([0xAA, 1]) + bytes(6)).hex()}


def test_a_lock_held_with_no_change_to_the_record_is_given_up_and_the_id_still_noted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A lock left held (a server hung while it held it) never stops a start: after
    `_LOCK_WAIT_S` with no change to the record, the record is updated without it, said once."""
    monkeypatch.setattr(retired, "_LOCK_WAIT_S", 0.3)
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    fd = _hold_lock(folder)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="galahad"):
            note_retired_keys(str(folder), bytes([0xCC, 1]) + bytes(6), [bytes([0xAA, 1]) + bytes(6)])
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        os.close(fd)
    (said,) = [r.getMessage() for r in caplog.records if "stayed locked" in r.getMessage()]
    assert "with no change to the record" in said and "updated without the lock" in said
    assert _ids(folder / RECORD_NAME) == {(bytes([0xAA, 1]) + bytes(6)).hex()}


def test_a_record_that_cannot_be_read_whole_is_left_as_it_is(tmp_path: Path) -> None:
    """A record over the size limit used to be read in part and rewritten from that part: of an
    operator's 5000 ids, 1144 were dropped without a word. One that cannot be read at all (a
    folder, a link, a FIFO, another user's 0600 file) was rewritten as if empty. Now either is
    left alone, said at WARNING, and nothing is known retired (entries are kept: the safe side)."""
    big = tmp_path / "big"
    big.mkdir(mode=0o700)
    record = big / RECORD_NAME
    record.write_text("".join(f"{n:016x}\n" for n in range(5000)))
    before = record.read_bytes()
    assert note_retired_keys(str(big), bytes(8), [bytes([9]) * 8]) == frozenset()
    assert record.read_bytes() == before
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_text(f"{'02' * 8}\n")
    os.symlink(tmp_path / "elsewhere", linked / RECORD_NAME)
    assert note_retired_keys(str(linked), bytes(8), [bytes([9]) * 8]) == frozenset()
    assert (linked / RECORD_NAME).is_symlink() and (tmp_path / "elsewhere").read_text() == f"{'02' * 8}\n"


def test_a_temporary_file_a_killed_writer_left_is_removed_by_a_later_start(tmp_path: Path) -> None:
    """A server killed between creating its temporary record and renaming it left
    `.tmp-galahad-retired-keys-*` in the store folder for good: the store's scans walk only the
    namespace folders. A later start removes one older than ten minutes (a younger one may be
    another start's write in progress)."""
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    old, young = folder / f".tmp-{RECORD_NAME}-00112233aabbccdd", folder / f".tmp-{RECORD_NAME}-44556677eeff0011"
    for temp in (old, young):
        temp.write_text("# key ids retired on purpose\n")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    note_retired_keys(str(folder), bytes(8), ())  # a start with nothing to note: the record is not written
    assert sorted(os.listdir(folder)) == [young.name, LOCK_NAME]
