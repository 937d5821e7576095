"""Saves sealed and written by writer processes (`galahad.adapters.helpers.pool`, `work="write"`)
over the real filesystem store.

Real processes, real descriptors passed over a Unix socket, real shared memory: the payload lies
in the shared region (where a GPU worker's save copies it), the store creates the part's file and
hands its descriptor to a writer, which seals the part from the region into it; the store places
it. The part opens in process to the same bytes and counters as one sealed in process; a writer
that is killed turns the pool off and the part is sealed here instead; what the disk or the codec
refuses comes back as the same refusal. (The GPU side, the save arena pinned for the GPU and a
vLLM worker saving through it, is in tests/gpu.)"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path

import pytest

from galahad.adapters.crypto.aesgcm import AES_GCM_CIPHER_ID
from galahad.adapters.crypto.key import Keyring
from galahad.adapters.helpers.pool import HelperPool, HelperRecipe, SharedRegion
from galahad.app.service import KVCacheService, SegmentSpec
from galahad.bootstrap import writer_processes_for
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.error import FormatError
from galahad.domain.secret import SecretKey
from galahad.format import codec
from galahad.format.v1 import encode_header
from helpers.services import helper_service

LAYERS = 4
SHAPE = (4, 2, 16, 64)  # float32: 32 KiB per layer, 128 KiB per entry
NBYTES = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
SEGMENTS = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
SLOT = LAYERS * NBYTES


def _writers(svc: KVCacheService, keyring: Keyring | None, processes: int = 2) -> HelperPool:
    pool = HelperPool(SharedRegion(8 * SLOT), HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)),
                      processes, work="write")
    svc.attach_writers(pool)
    return pool


def _save(svc: KVCacheService, pool: HelperPool, i: int, *, shared: bool = True) -> tuple[ChainKey, list[bytes]]:
    """Entry i's payload put into slot i of the region (as a GPU save copies it there), then saved
    from it: by a writer when `shared`, else as a payload the writers cannot see."""
    key = svc.keys(list(range(64 * (i + 1) + 1)), svc.seed())[svc.chunking.key_index(64 * (i + 1))]
    payload = [os.urandom(NBYTES) for _ in range(LAYERS)]
    at = (i % 8) * SLOT
    region = pool.region.view
    views = []
    for n, layer in enumerate(payload):
        region[at + n * NBYTES : at + (n + 1) * NBYTES] = layer
        views.append(region[at + n * NBYTES : at + (n + 1) * NBYTES])
    assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, SEGMENTS, views, shared_at=at if shared else None)
    assert svc.commit(key)
    return key, payload


def _part_file(root: Path, key: ChainKey) -> Path:
    (found,) = root.rglob(f"{key.hex}.p0.blk")
    return found


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "checksummed"])
def test_a_writer_process_seals_the_part_that_loads_back_as_one_sealed_here(tmp_path: Path, sealed: bool) -> None:
    keyring = Keyring(SecretKey(os.urandom(32))) if sealed else None
    svc = helper_service(tmp_path / "store", keyring)
    pool = _writers(svc, keyring)
    assert len(set(pool.pids()) | {os.getpid()}) == 3  # two writers, neither of them this process
    saved = [_save(svc, pool, i) for i in range(5)]
    assert pool.parts_written == 5  # every part was sealed and written by a writer
    here_key, here_payload = _save(svc, pool, 5, shared=False)  # sealed in this process
    assert pool.parts_written == 5
    pool.region.view[:] = bytes(len(pool.region.view))  # the region is reused: the files stand alone
    for key, payload in [*saved, (here_key, here_payload)]:
        part = svc.load_part(key, 0)
        assert part is not None and [bytes(v) for v in part.segment_views()] == payload
        assert part.header.cipher_id == (AES_GCM_CIPHER_ID if sealed else 0)
    root = tmp_path / "store"
    sizes = {_part_file(root, key).stat().st_size for key, _ in saved}
    assert sizes == {_part_file(root, here_key).stat().st_size}  # the same file the codec writes here
    if sealed:  # no plaintext reaches the disk
        assert saved[0][1][0][:4096] not in _part_file(root, saved[0][0]).read_bytes()
    assert svc.counters.saves == 6 and svc.counters.saves_skipped == 0
    assert svc.counters.bytes_saved == len(saved) * sizes.pop() * 6 // 5
    svc.close()
    assert not pool.running  # the service closed its writers


def test_a_part_present_is_left_alone_and_a_damaged_one_is_placed_anew_by_a_writer(tmp_path: Path) -> None:
    """The store looks the part's name up as it places it: a whole part there makes the save a
    no-op without a writer asked; a part cut short there is set aside and a writer places it anew."""
    svc = helper_service(tmp_path / "store")
    pool = _writers(svc, None, processes=1)
    key, payload = _save(svc, pool, 0)
    path = _part_file(tmp_path / "store", key)
    whole = path.read_bytes()
    views = [pool.region.view[n * NBYTES : (n + 1) * NBYTES] for n in range(LAYERS)]
    assert not svc.save_part(key, Span(0, 64), 0, SEGMENTS, views, shared_at=0)  # present: nothing done
    assert pool.parts_written == 1 and path.read_bytes() == whole
    os.truncate(path, 1000)
    assert svc.save_part(key, Span(0, 64), 0, SEGMENTS, views, shared_at=0) and svc.commit(key)
    assert pool.parts_written == 2 and path.stat().st_size == len(whole)
    assert svc.counters.quarantined == 1
    part = svc.load_part(key, 0)
    assert part is not None and [bytes(v) for v in part.segment_views()] == payload
    svc.close()


def test_a_killed_writer_turns_the_pool_off_once_and_the_part_is_sealed_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = helper_service(tmp_path / "store", keyring)
    pool = _writers(svc, keyring, processes=1)
    (pid,) = pool.pids()
    os.kill(pid, 9)
    with caplog.at_level(logging.WARNING, logger="galahad.adapters.helpers.pool"):
        saved = [_save(svc, pool, i) for i in range(3)]
    assert not pool.running and pool.parts_written == 0
    offs = [r.getMessage() for r in caplog.records if "OFF" in r.getMessage()]
    assert len(offs) == 1 and offs[0].startswith("[galahad] writer processes OFF: a writer process failed")
    assert offs[0].endswith("parts are sealed and written in this process from now on")
    for key, payload in saved:
        part = svc.load_part(key, 0)
        assert part is not None and [bytes(v) for v in part.segment_views()] == payload
    assert svc.counters.saves == 3 and svc.counters.saves_skipped == 0
    assert not list((tmp_path / "store").rglob(".tmp*"))  # the file given to the dead writer went
    svc.close()


def test_a_write_the_disk_refuses_comes_back_with_its_errno_and_the_pool_keeps_running(tmp_path: Path) -> None:
    """A writer's `OSError` is the disk's answer, not a lost writer: ENOSPC from a full tmpfs, and
    nothing is left in the folder (neither the part nor its temp file)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = helper_service(tmp_path / "store", keyring)
    pool = _writers(svc, keyring, processes=1)
    header = _header(svc, keyring)
    fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as refused:
            pool.seal_and_place(fd, "part.blk", 1, _sealed_size(header), header, 0, [NBYTES] * LAYERS)
        assert refused.value.errno == errno.ENOSPC
        assert pool.running and os.listdir(fd) == []
    finally:
        os.close(fd)
        subprocess.run(["umount", "-l", str(full)], check=False)
    svc.close()


def test_a_writer_names_a_part_only_whole_and_only_where_the_name_is_free(tmp_path: Path) -> None:
    """The writer checks the count it sealed against the size the store expects (a header that
    says otherwise never takes the name), and keeps a name another process took meanwhile."""
    svc = helper_service(tmp_path / "store")
    pool = _writers(svc, None, processes=1)
    header = _header(svc, None)
    folder = tmp_path / "folder"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError, match="bytes were written, not") as wrong:
            pool.seal_and_place(fd, "part.blk", 1, _sealed_size(header) + 1, header, 0, [NBYTES] * LAYERS)
        assert wrong.value.errno == errno.EIO and os.listdir(fd) == []
        assert pool.seal_and_place(fd, "part.blk", 7, _sealed_size(header), header, 0, [NBYTES] * LAYERS)
        assert os.stat(folder / "part.blk").st_mtime_ns == 7  # stamped with the store's tick
        assert not pool.seal_and_place(fd, "part.blk", 8, _sealed_size(header), header, 0, [NBYTES] * LAYERS)
        assert os.listdir(fd) == ["part.blk"]  # the first stands, no temp file left
    finally:
        os.close(fd)
    assert pool.running and pool.parts_written == 1
    svc.close()


def test_a_payload_that_is_not_the_headers_is_refused_as_the_codec_refuses_it(tmp_path: Path) -> None:
    svc = helper_service(tmp_path / "store")
    pool = _writers(svc, None, processes=1)
    header = _header(svc, None)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FormatError, match="segment 0"):
            pool.seal_and_place(fd, "out.blk", 1, _sealed_size(header), header, 0, [NBYTES // 2] * LAYERS)
        with pytest.raises(ValueError, match="not inside"):
            pool.seal_and_place(fd, "out.blk", 1, _sealed_size(header), header, len(pool.region.view) - NBYTES,
                                [NBYTES] * LAYERS)
    finally:
        os.close(fd)
    assert pool.running and not list(tmp_path.glob("out.blk")) and not list(tmp_path.glob(".tmp*"))
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    short = [pool.region.view[i * NBYTES : (i + 1) * NBYTES - 4] for i in range(LAYERS)]
    assert not svc.save_part(key, Span(0, 64), 0, SEGMENTS, short, shared_at=0)  # skipped, counted
    assert svc.counters.skipped == {"format": 1}
    assert not list((tmp_path / "store").rglob("*.blk"))
    svc.close()


def _sealed_size(header: bytes) -> int:
    """The file size of the part whose header (before sealing) is `header`."""
    from galahad.format.v1 import decode_header

    return codec.file_size(decode_header(header))


def _header(svc: KVCacheService, keyring: Keyring | None) -> bytes:
    """A part's encoded header as the engine process sends it to a writer."""
    from galahad.app.segment import header_segments
    from galahad.format.v1 import BlockHeader

    cipher_id, key_id = (AES_GCM_CIPHER_ID, keyring.current().key_id) if keyring else (0, bytes(8))
    return encode_header(BlockHeader(namespace=svc.digest, chain_key=bytes(32), token_start=0, token_end=64, rank=0,
                                     world=1, block_size=16, segments=header_segments(tuple(SEGMENTS)),
                                     frame_size=codec.DEFAULT_FRAME_SIZE, cipher_id=cipher_id, key_id=key_id))


def test_writers_start_only_on_many_cores() -> None:
    assert [writer_processes_for(c) for c in (1, 2, 4, 7, 8, 15, 16, 32, 64)] == [0, 0, 0, 0, 2, 2, 4, 4, 4]
    # each tensor parallel worker starts its own: the cores are shared between them
    assert [writer_processes_for(32, r) for r in (1, 2, 4, 8)] == [4, 4, 2, 0]


def test_a_whole_prompts_part_of_many_frames_is_sealed_by_a_writer(tmp_path: Path) -> None:
    """`layer` order saves a prompt as one part: 24 MiB here, six 4 MiB frames sealed in one writer."""
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = helper_service(tmp_path / "store", keyring)
    big = (96, 2, 16, 512)  # float32: 6 MiB per layer
    layer = 4 * 96 * 2 * 16 * 512
    region = SharedRegion(LAYERS * layer)
    pool = HelperPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)), 1, work="write")
    svc.attach_writers(pool)
    payload = os.urandom(LAYERS * layer)
    region.view[:] = payload
    key = svc.keys(list(range(1537)), svc.seed())[svc.chunking.key_index(1536)]
    views = [region.view[i * layer : (i + 1) * layer] for i in range(LAYERS)]
    specs = [SegmentSpec(0, i, 0, "float32", big) for i in range(LAYERS)]
    assert svc.save_part(key, Span(0, 1536), 0, specs, views, shared_at=0) and svc.commit(key)
    assert pool.parts_written == 1
    part = svc.load_part(key, 0)
    assert part is not None and bytes(part.payload) == payload
    assert part.header.payload_len // part.header.frame_size == 6
    svc.close()


def test_a_writer_keeps_its_sealing_buffer_only_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part beyond the bound (a 32k-token prompt in `layer` order is 4.8 GB) is sealed into
    memory of its own, given back once written: four writers never hold gigabytes between saves."""
    import mmap

    from galahad.adapters.helpers import pool as helper_pool

    monkeypatch.setattr(helper_pool, "_SEAL_KEPT", 1 << 20)
    buffers = helper_pool._SealBuffer()
    small = buffers.take(1 << 20)
    assert small.obj is buffers._buf and len(small) == 1 << 20
    large = buffers.take(3 << 20)
    assert isinstance(large.obj, mmap.mmap) and len(large) == 3 << 20
    assert len(buffers._buf) == 1 << 20  # the kept one did not grow


def test_a_placed_part_is_put_as_any_other_and_a_refusal_is_the_stores(tmp_path: Path) -> None:
    """`PlacesParts.put_placed`: the store makes and checks the folder, then `place` writes and
    names the file in it; a part present is a no-op, as `put`, and the disk's refusal of a step
    is the store's `StoreUnavailable`, naming the file."""
    from galahad.adapters.posix.atomic import CREATE, write_atomically
    from galahad.domain.error import StoreUnavailable

    svc = helper_service(tmp_path / "store")
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    store = svc.store
    folders: list[int] = []

    def place(dir_fd: int, name: str, tick: int) -> bool:
        folders.append(dir_fd)

        def fill(tmp: str) -> int:
            fd = os.open(tmp, CREATE, 0o600, dir_fd=dir_fd)
            os.write(fd, b"x" * 100)
            return fd

        return write_atomically(dir_fd, name, fill, tick, replace=False, looked=True)

    def refused(dir_fd: int, name: str, tick: int) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StoreUnavailable, match="the disk is full") as caught:
        store.put_placed(key, 0, 100, refused)
    assert caught.value.errno == errno.ENOSPC and store.part_size(key, 0) is None
    assert store.put_placed(key, 0, 100, place) and store.part_size(key, 0) == 100
    assert not store.put_placed(key, 0, 100, place) and len(folders) == 1  # present: place not asked
    assert not list((tmp_path / "store").rglob(".tmp*"))
    svc.close()


def test_a_hung_writer_is_given_up_after_its_timeout_and_the_part_is_sealed_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from galahad.adapters.helpers import pool as helper_pool

    monkeypatch.setattr(helper_pool, "_REPLY_TIMEOUT_S", 1.0)  # and 1 s per 20 MB: 128 KiB adds nothing
    keyring = Keyring(SecretKey(os.urandom(32)))
    svc = helper_service(tmp_path / "store", keyring)
    pool = _writers(svc, keyring, processes=1)
    (pid,) = pool.pids()
    os.kill(pid, 19)  # SIGSTOP: alive, never answers (a write stuck on a dead disk)
    t0 = time.monotonic()
    key, payload = _save(svc, pool, 0)
    assert time.monotonic() - t0 < 10  # the timeout, then the kill; sealed here instead
    assert not pool.running and pool.parts_written == 0
    part = svc.load_part(key, 0)
    assert part is not None and [bytes(v) for v in part.segment_views()] == payload
    assert not list((tmp_path / "store").rglob(".tmp*"))
    svc.close()
