"""A part the disk cannot read is refused and set aside like a damaged one; a failure that is not
the part's own leaves the entry in the store.

docs/vllm.md: "a stored block that cannot be read or fails verification is refused ... Galahad
quarantines the entry so it is not offered again". The store is real (files, fsync, rename, the
quarantine folder); the disk error is not: nothing here can make a real disk fail one read, so
`os.preadv` and `os.pread` are replaced for one load by a function that fails the way the kernel
does on a bad sector (OSError EIO), or with EMFILE (too many open files: the process's trouble,
not the file's)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import helper_service

SHAPE = (4, 2, 16, 64)  # float32: 32 KiB a layer


def _saved(svc: KVCacheService) -> tuple[ChainKey, list[bytes]]:
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    payload = [os.urandom(4 * 4 * 2 * 16 * 64) for _ in range(4)]
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(4)]
    assert svc.save_part(key, Span(0, 64), 0, segments, payload) and svc.commit(key)
    return key, payload


def _failing(code: int):  # noqa: ANN202 - the stand-in for a read the kernel fails
    def read(*_args: object) -> int:
        raise OSError(code, os.strerror(code))
    return read


@pytest.mark.parametrize(("code", "set_aside"), [(errno.EIO, True), (errno.EMFILE, False)])
def test_a_read_error_refuses_the_part_and_only_a_disk_error_sets_the_entry_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, set_aside: bool) -> None:
    svc = helper_service(tmp_path / "store")
    try:
        key, payload = _saved(svc)
        with monkeypatch.context() as m:
            m.setattr(os, "preadv", _failing(code))
            m.setattr(os, "pread", _failing(code))
            assert svc.load_part(key, 0) is None  # refused, never an exception
        c = svc.counters
        assert c.refused.get("io") == 1 and c.load_failures == 1
        assert c.quarantined == (1 if set_aside else 0)
        assert svc.store.is_committed(key) is not set_aside
        again = svc.load_part(key, 0)  # the disk reads again
        if set_aside:
            assert again is None and c.refused.get("missing") == 1  # not offered: no rank reads it
        else:
            assert again is not None and bytes(again.payload) == b"".join(payload)
    finally:
        svc.close()
