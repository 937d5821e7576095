"""A part of a newer format in a shared store (spec §8): a newer major version, or an incompat
flag this reader does not know, is a miss here, counted `refused_format`, and never quarantined,
deleted or written over: the newer servers sharing the store read it, so a fleet upgraded one
server at a time loses nothing. Real files, real services; the newer writer is stood in for by
rewriting the preamble of a part this version wrote (the only bytes a newer reader would read
first, with the header checksum such a writer gives it)."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import xxhash

from galahad.adapters.fs.layout import part_name
from galahad.domain.chunking import Span
from galahad.app.service import SegmentSpec
from helpers.services import helper_service

SPECS = [SegmentSpec(0, layer, 0, "float32", (2, 16, 4, 4)) for layer in range(4)]
PAYLOAD = [bytes([layer]) * (2 * 16 * 4 * 4 * 4) for layer in range(4)]


def _part(root: Path, keyhex: str) -> Path:
    return next(root.rglob(part_name(keyhex, 0)))


@pytest.mark.parametrize(("offset", "fmt", "value"), [(8, "<H", 2), (12, "<I", 0x1 | 0x100)],
                         ids=["major-2", "unknown-incompat-flag"])
def test_a_newer_writers_part_is_a_miss_that_is_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, offset: int, fmt: str, value: int) -> None:
    root = tmp_path / "store"
    writer = helper_service(root)
    key = writer.keys(list(range(300)), writer.seed())[writer.chunking.key_index(64)]
    assert writer.save_part(key, Span(0, 64), 0, SPECS, PAYLOAD) and writer.commit(key)
    writer.close()
    path = _part(root, key.hex)
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    header_len = struct.unpack_from("<I", data, 20)[0]  # a newer writer's header checksum is whole
    data[header_len - 16 : header_len] = xxhash.xxh3_128_digest(bytes(data[: header_len - 16]))
    path.write_bytes(data)

    reader = helper_service(root)
    try:
        with caplog.at_level(logging.WARNING, logger="galahad"):
            assert reader.lookup(list(range(300)), reader.seed()) is None  # not offered
        assert any("newer Galahad format" in r.getMessage() for r in caplog.records)
        assert reader.load_part(key, 0) is None  # asked anyway: a miss
        assert reader.last_miss() == "format"
        counters = reader.snapshot_counters()
        assert counters.refused == {"format": 1} and counters.quarantined == 0
        assert reader.is_committed(key) and path.read_bytes() == data
        assert reader.holds(key)  # a save of the same prompt has nothing to do
        reader.save_part(key, Span(0, 64), 0, SPECS, PAYLOAD)
        assert path.read_bytes() == data  # never written over
    finally:
        reader.close()


def test_an_older_or_foreign_major_is_still_set_aside(tmp_path: Path) -> None:
    """Major 0 is no Galahad format (a forged or foreign file): refused and quarantined, as ever."""
    root = tmp_path / "store"
    svc = helper_service(root)
    try:
        key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
        assert svc.save_part(key, Span(0, 64), 0, SPECS, PAYLOAD) and svc.commit(key)
        path = _part(root, key.hex)
        data = bytearray(path.read_bytes())
        struct.pack_into("<H", data, 8, 0)
        path.write_bytes(data)
        assert svc.load_part(key, 0) is None and svc.last_miss() == "format"
        assert svc.snapshot_counters().quarantined == 1 and not svc.is_committed(key)
    finally:
        svc.close()
