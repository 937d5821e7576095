"""The compiled read-and-verify loop (`galahad.adapters.posix._readhash`, `galahad.adapters.posix.readhash`): a checksum frame
read from a real file and hashed in one call, outside the interpreter lock.

What it must keep: the same bytes, count and digest as the Python loop (`read_stepwise` with the
hash's `update`), the same refusals for damaged bytes, the same errors for a failing read, and a
working install where it could not be built (the Python loop serves). Real files and a real store
throughout; the one disk error that no real disk here can produce (EIO) is stood in for at the
loop's Python boundary, as tests/integration/test_read_errors.py does for `os.preadv`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from galahad.adapters.posix import readhash
from galahad.adapters.fs import FilesystemBlockStore
from galahad.bootstrap import open_cache
from galahad.config import read_settings
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.error import StoreUnavailable
from galahad.domain.rank import RankLayout
from galahad.ports.store import HashedReader
from galahad.app.service import SegmentSpec
from helpers.services import helper_service
from helpers.store_worker import NAMESPACE
from vllm_support.licence import make_licence

MiB = 1 << 20
SHAPE = (4, 2, 16, 3072)  # float32: 1.5 MiB a layer, 6 MiB a part: two 4 MiB frames, many reads a frame
PAYLOAD = os.urandom(5 * MiB + 12345)

built = pytest.mark.skipif(not readhash.available(), reason="galahad.adapters.posix._readhash was not built here (no C compiler)")


def key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"read hashed %d" % n).digest())


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FilesystemBlockStore]:
    root = tmp_path_factory.mktemp("readhash")
    root.chmod(0o700)
    store = FilesystemBlockStore(root, NAMESPACE, rescan_s=None, max_bytes=1 << 40)
    assert store.wait_indexed(30)
    store.put(key(0), 0, PAYLOAD)
    yield store
    store.close()


@pytest.fixture(params=["compiled", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each load test twice: through the compiled loop, and with it switched off (an install
    where it was not built)."""
    if request.param == "compiled":
        if not readhash.available():
            pytest.skip("galahad.adapters.posix._readhash was not built here")
    else:
        monkeypatch.setattr(readhash, "_native", None)
    return str(request.param)


def test_ci_builds_the_compiled_loop() -> None:
    """The extension is optional at install (a user without a compiler still gets Galahad), so a
    broken build would pass unseen; CI, which has a compiler, must have built it."""
    if not os.environ.get("GALAHAD_CI"):
        pytest.skip("checked in CI (GALAHAD_CI=1), where a C compiler is present")
    assert readhash.available(), "setup.py did not build galahad.adapters.posix._readhash: see the install's output"


@built
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, len(PAYLOAD) + 10), size=st.integers(0, 3 * MiB), seed=st.integers(0, 2**64 - 1),
       step=st.sampled_from([1, 4096, 65536, 262144, 1 << 20]))
def test_the_compiled_loop_reads_and_hashes_what_the_python_loop_does(
        stored: FilesystemBlockStore, offset: int, size: int, seed: int, step: int) -> None:
    with stored.open_reader(key(0), 0) as reader:  # type: ignore[union-attr]
        assert isinstance(reader, HashedReader)
        fast = memoryview(mmap.mmap(-1, max(size, 1)))[:size]
        slow = memoryview(bytearray(size))
        readhash_step, readhash.STEP = readhash.STEP, step
        try:
            done = reader.read_hashed(offset, fast, seed)
        finally:
            readhash.STEP = readhash_step
        state = xxhash.xxh3_128(seed=seed)
        count = reader.read_stepwise(offset, slow, 65536, state.update)
        assert done is not None
        got, digest = done
        want = max(0, min(size, len(PAYLOAD) - offset))
        assert got == count == want
        assert fast[:got] == slow[:got] == PAYLOAD[offset : offset + got]
        assert digest == xxhash.xxh3_128(PAYLOAD[offset : offset + got], seed=seed).digest()


@built
def test_the_compiled_loop_declines_what_it_cannot_read_and_the_python_loop_says_why(
        stored: FilesystemBlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = stored.open_reader(key(0), 0)
    assert reader is not None
    view = memoryview(bytearray(100))
    assert reader.read_hashed(-1, view, 0) is None  # read_stepwise then refuses it
    with pytest.raises(ValueError):
        reader.read_stepwise(-1, view, 10, lambda p: None)
    with pytest.raises(ValueError):
        reader.read_hashed(0, memoryview(bytes(10)), 0)  # read-only: refused as preadv refuses it
    with monkeypatch.context() as m:
        m.setattr(readhash, "_native", None)
        assert reader.read_hashed(0, view, 0) is None
    reader.close()
    assert reader.read_hashed(0, view, 0) is None  # closed: read_stepwise says so
    with pytest.raises(ValueError, match="closed"):
        reader.read_stepwise(0, view, 10, lambda p: None)


@built
def test_a_read_the_kernel_fails_in_the_compiled_loop_is_store_unavailable_with_its_errno(
        stored: FilesystemBlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real failure inside the C loop (the descriptor taken away behind the reader's back:
    EBADF from pread), and EIO stood in for at the loop's boundary."""
    with stored.open_reader(key(0), 0) as reader:  # type: ignore[union-attr]
        fd = reader._fd  # type: ignore[attr-defined]
        spare = os.dup(fd)
        os.close(fd)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                reader.read_hashed(0, memoryview(bytearray(10)), 0)
            assert caught.value.errno == errno.EBADF
        finally:
            os.dup2(spare, fd)
            os.close(spare)

        def eio(*_args: object) -> tuple[int, bytes]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(readhash, "_native", eio)
        with pytest.raises(StoreUnavailable, match="I/O error") as caught:
            reader.read_hashed(0, memoryview(bytearray(10)), 0)
        assert caught.value.errno == errno.EIO


def _saved(tmp_path: Path):  # noqa: ANN202
    svc = helper_service(tmp_path / "store")
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    payload = [os.urandom(4 * 4 * 2 * 16 * 3072) for _ in range(4)]
    segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(4)]
    assert svc.save_part(key, Span(0, 64), 0, segments, payload) and svc.commit(key)
    return svc, key, payload


def test_a_load_is_byte_exact_and_goes_through_the_loop_under_test(
        tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    if loop == "compiled":
        real = readhash._native
        assert real is not None
        monkeypatch.setattr(readhash, "_native", lambda *a: calls.append(a[1]) or real(*a))
    svc, key, payload = _saved(tmp_path)
    try:
        loaded = svc.load_part(key, 0)
        assert loaded is not None and bytes(loaded.payload) == b"".join(payload)
        assert bool(calls) is (loop == "compiled")  # the codec took the compiled loop when there was one
    finally:
        svc.close()


@pytest.mark.parametrize("where", [0, 300_000, 5_000_000, -1])  # first read, a later read, frame 1, its end
def test_a_flipped_byte_is_refused_and_quarantined_by_either_loop(tmp_path: Path, loop: str, where: int) -> None:
    svc, key, _ = _saved(tmp_path)
    try:
        [path] = [p for p in (tmp_path / "store").rglob("*") if p.name == f"{key.hex}.p0.blk"]
        blob = bytearray(path.read_bytes())
        at = 4096 + where if where >= 0 else len(blob) - 2 * 16 - 1  # the payload's last byte (two tags after it)
        blob[at] ^= 0x10
        path.write_bytes(bytes(blob))
        assert svc.load_part(key, 0) is None
        c = svc.counters
        assert c.refused.get("damaged") == 1 and c.quarantined == 1
    finally:
        svc.close()


def test_a_truncated_part_is_refused_by_either_loop(tmp_path: Path, loop: str) -> None:
    svc, key, _ = _saved(tmp_path)
    try:
        [path] = [p for p in (tmp_path / "store").rglob("*") if p.name == f"{key.hex}.p0.blk"]
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - 5000)
        assert svc.load_part(key, 0) is None
        assert svc.counters.load_failures == 1 and svc.counters.quarantined == 1
    finally:
        svc.close()


@pytest.mark.parametrize("built_here", [True, False])
def test_startup_says_so_only_when_the_loop_was_not_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, built_here: bool) -> None:
    if built_here and not readhash.available():
        pytest.skip("galahad.adapters.posix._readhash was not built here")
    if not built_here:
        monkeypatch.setattr(readhash, "_native", None)
    lic, pub = make_licence(tmp_path / "lic")
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
           "GALAHAD_LICENCE_ISSUER_KEY": pub}
    with caplog.at_level(logging.INFO, logger="galahad"):
        handle = open_cache(read_settings(env), NAMESPACE, RankLayout())
    try:
        assert handle.service is not None, handle.reason
        said = [r.getMessage() for r in caplog.records if "compiled read-and-verify loop" in r.getMessage()]
        assert len(said) == (0 if built_here else 1)
        assert all("reinstall Galahad where gcc and the Python headers are present" in s for s in said)
    finally:
        handle.service.close()
