"""Opening a large store is fast: open does not walk the folder; a background scan indexes it."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore, marker
from galahad.adapters.fs.layout import leaf_dir, marker_name, part_name
from galahad.domain.chain import ChainKey
from helpers.store_worker import NAMESPACE

PART_BYTES = 100


def _fill(root: Path, entries: int) -> list[ChainKey]:
    """`entries` committed one-part entries (2 files each), written straight into the layout."""
    FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=None).close()
    ns_dir = str(root / f"ns-{NAMESPACE.hex}")
    keys = [ChainKey(hashlib.sha256(b"scale %d" % n).digest()) for n in range(entries)]
    made: set[str] = set()
    ok = marker.encode({0: PART_BYTES})
    for k in keys:
        folder = leaf_dir(ns_dir, k.hex)
        if folder not in made:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            made.add(folder)
        for name, data in ((part_name(k.hex, 0), bytes(PART_BYTES)), (marker_name(k.hex), ok)):
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
    return keys


def _open_fast(root: Path, keys: list[ChainKey]) -> None:
    started = time.perf_counter()
    store = FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 40, rescan_s=None)
    opened = time.perf_counter() - started
    try:
        indexed_at_open = store.wait_indexed(0)
        assert store.is_committed(keys[-1]) and store.get(keys[0], 0) == bytes(PART_BYTES)  # usable at once
        assert opened < 1.0, f"open took {opened:.2f} s"
        assert not indexed_at_open, "open walked the whole folder before returning"
        assert store.wait_indexed(300)
        scanned = time.perf_counter() - started
        assert store.used_bytes() == len(keys) * PART_BYTES and store.stats()["entries"] == len(keys)
        print(f"{2 * len(keys)} files: open {opened * 1000:.1f} ms, indexed after {scanned:.2f} s")
    finally:
        store.close()


def test_a_store_of_20k_files_opens_at_once_and_indexes_in_the_background(tmp_path: Path) -> None:
    _open_fast(tmp_path, _fill(tmp_path, 10_000))


@pytest.mark.slow
def test_a_store_of_200k_files_opens_in_under_a_second(tmp_path: Path) -> None:
    _open_fast(tmp_path, _fill(tmp_path, 100_000))
