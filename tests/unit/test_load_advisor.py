"""Load or recompute from measured figures: the advisor the vLLM scheduler side asks per hit,
and the page-cache residency it is given (real files, real `mincore`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from galahad.adapters.fs.residency import resident_share
from galahad.adapters.vllm.advisor import LoadAdvisor
from galahad.domain.cost import PrefillFloor

MB = 1_000_000


def _advisor(**kw: object) -> LoadAdvisor:
    """An advisor that measures every load, the first too (see the warm-up test)."""
    return LoadAdvisor(warm_up=False, **kw)  # type: ignore[arg-type]


def test_without_a_measured_prefill_step_a_hit_is_loaded() -> None:
    advisor = _advisor()
    assert advisor.choose(2048, 300 * MB, 0.0) is None  # no figures: load


def test_a_warm_hit_that_loads_faster_than_its_prefill_is_loaded() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    advisor.observe_load(300 * MB, 0.015, share=1.0)  # 20 GB/s from the page cache
    choice = advisor.choose(2048, 300 * MB, 1.0)
    assert choice is not None and choice.load


def test_a_hit_on_a_slow_uncached_disk_is_recomputed() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    advisor.observe_load(300 * MB, 0.220, share=0.0)  # 1.4 GB/s from the disk
    choice = advisor.choose(2048, 300 * MB, 0.0)
    assert choice is not None and not choice.load
    assert choice.load_s > choice.recompute_s


def test_before_a_cold_load_was_measured_the_disk_is_priced_conservatively() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    choice = advisor.choose(2048, 300 * MB, 0.0)
    assert choice is not None and not choice.load  # 300 MB at the 1 GB/s prior: 300 ms > 50 ms
    warm = advisor.choose(2048, 300 * MB, 1.0)
    assert warm is not None and warm.load  # the page cache prior: 8 GB/s, 38 ms < 50 ms


def test_a_slow_engine_makes_even_a_cold_load_worth_it() -> None:
    advisor = _advisor()
    advisor.observe_step(1024, 2.0)  # a CPU engine: 2 s for 1k tokens
    choice = advisor.choose(1024, 150 * MB, 0.0)
    assert choice is not None and choice.load


def test_short_steps_and_nonsense_figures_are_ignored() -> None:
    advisor = _advisor()
    advisor.observe_step(16, 0.010)  # a decode step tells nothing about prefill
    advisor.observe_step(4096, 0.0)
    advisor.observe_load(0, 1.0, 1.0)
    assert advisor.model() is None


def test_figures_follow_the_deployment_as_it_changes() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    for _ in range(20):  # the disk got faster (or the store moved to a faster one)
        advisor.observe_load(300 * MB, 0.030, share=0.0)
    choice = advisor.choose(2048, 300 * MB, 0.0)
    assert choice is not None and choice.load
    assert "cold 10.0" in advisor.describe()


def _drop(path: Path, length: int = 0) -> None:
    """Ask the kernel to drop the file's first `length` bytes (0: all) from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_residency_of_a_file_follows_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "part"
    path.write_bytes(os.urandom(8 << 20))
    assert resident_share(str(path)) == pytest.approx(1.0)
    _drop(path)
    share = resident_share(str(path))
    if share is None or share > 0.5:
        pytest.skip("this filesystem keeps the file in memory whatever (tmpfs)")
    assert share < 0.5
    assert resident_share(str(tmp_path / "absent")) is None


def test_residency_starts_no_child_process_at_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first priced hit of a process loads the C library on the engine's thread: by name, not
    through `ctypes.util.find_library`, which runs `ldconfig` in a child process."""
    import ctypes.util
    import subprocess

    from galahad.adapters.fs import residency

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a child process was started")

    monkeypatch.setattr(residency, "_LIBC", [])  # as in a process that has priced nothing yet
    monkeypatch.setattr(ctypes.util, "find_library", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    path = tmp_path / "part"
    path.write_bytes(os.urandom(1 << 20))
    assert resident_share(str(path)) == pytest.approx(1.0)


def test_small_loads_are_always_made_and_never_measured() -> None:
    advisor = _advisor()
    advisor.observe_step(640, 0.001)  # a tiny model: prefill costs next to nothing
    advisor.observe_load(2 * MB, 0.005, share=1.0)  # mostly fixed costs: not a bandwidth
    assert advisor.choose(640, 2 * MB, 0.0) is None
    assert "warm prior" in advisor.describe()


def test_figures_outlive_the_process_and_a_damaged_file_is_ignored(tmp_path: Path) -> None:
    path = str(tmp_path / "figures.json")
    first = _advisor(path=path)
    first.observe_step(2048, 0.050)
    first.observe_load(300 * MB, 0.220, share=0.0)
    first.save(force=True)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    again = _advisor(path=path)  # the restarted server decides at once, on the last run's figures
    choice = again.choose(2048, 300 * MB, 0.0)
    assert choice is not None and not choice.load
    Path(path).write_text("{not json")
    assert _advisor(path=path).model() is None


def test_a_warm_figure_that_says_recompute_is_measured_again_every_ninth_hit() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    advisor.observe_load(300 * MB, 0.300, share=1.0)  # 1 GB/s: measured while pinning buffers
    choices = [advisor.choose(2048, 300 * MB, 1.0) for _ in range(18)]
    loaded = [i for i, c in enumerate(choices) if c is not None and c.load]
    assert loaded == [8, 17]
    assert all(c is not None and not c.load for i, c in enumerate(choices) if i not in loaded)
    for _ in range(4):  # those loads were fast: the figure recovers and loads are chosen again
        advisor.observe_load(300 * MB, 0.015, share=1.0)
    again = advisor.choose(2048, 300 * MB, 1.0)
    assert again is not None and again.load


def test_a_cold_hit_that_loses_is_never_retried() -> None:
    advisor = _advisor()
    advisor.observe_step(2048, 0.050)
    advisor.observe_load(300 * MB, 0.220, share=0.0)  # 1.4 GB/s from the disk
    assert all(c is not None and not c.load for c in (advisor.choose(2048, 300 * MB, 0.0) for _ in range(30)))


def test_the_first_load_of_a_process_is_a_warm_up_and_not_measured() -> None:
    advisor = LoadAdvisor()
    advisor.observe_step(2048, 0.050)
    advisor.observe_load(300 * MB, 0.140, share=1.0)  # 2.1 GB/s: threads starting, library loading
    choice = advisor.choose(2048, 300 * MB, 1.0)
    assert choice is not None and choice.load  # still on the prior, not on the warm-up
    advisor.observe_load(300 * MB, 0.140, share=1.0)  # the second is measured
    choice = advisor.choose(2048, 300 * MB, 1.0)
    assert choice is not None and not choice.load
    assert "warm 2.1" in advisor.describe()


def test_a_large_files_residency_is_told_from_spread_windows(tmp_path: Path) -> None:
    """Over 16 MiB only 16 spread windows are asked about; half the file dropped reads as about half."""
    path = tmp_path / "large"
    path.write_bytes(os.urandom(64 << 20))
    assert resident_share(str(path)) == pytest.approx(1.0)
    _drop(path, 32 << 20)  # the first half leaves the cache
    share = resident_share(str(path))
    if share is None or share > 0.9:
        pytest.skip("this filesystem keeps the file in memory whatever (tmpfs)")
    assert share == pytest.approx(0.5, abs=0.05)


# A model of 16 layers, 1024 wide (the restart benchmark's): no hardware prefills 2048 of its
# tokens in under about 9 µs
FLOOR = PrefillFloor(flops_per_token=2.0 * 2 * 16 * 1024 * 1024, layers=16)


def test_a_prefill_step_faster_than_any_hardware_is_refused_said_once_and_hits_load(
        caplog: pytest.LogCaptureFixture) -> None:
    advisor = _advisor(floor=FLOOR)
    with caplog.at_level(logging.WARNING, logger="galahad"):
        advisor.observe_step(2048, 0.000_001)  # a clock read on either side of nothing
        advisor.observe_step(1024, 0.000_000_5)
    assert advisor.model() is None
    assert advisor.choose(2048, 300 * MB, 0.0) is None  # load: the default, not "recompute is free"
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "2048 tokens" in refused[0].getMessage()
    advisor.observe_step(2048, 12.0)  # the real figure is taken
    assert advisor.model() is not None


def test_absurd_figures_in_the_file_are_refused_and_hits_load(tmp_path: Path) -> None:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"version": 1, "prefill": [[1024, 0.0], [2048, 0.000_001], [4096, -1.0]],
                                "warm_bps": 1.0, "cold_bps": 1e20}))
    advisor = _advisor(path=str(path), floor=FLOOR)
    assert advisor.model() is None
    assert advisor.choose(2048, 300 * MB, 0.0) is None
    assert advisor.describe() == "prefill []; load GB/s warm prior 8.0, cold prior 1.0"


def test_a_file_figure_contradicted_by_a_step_measured_here_is_dropped(tmp_path: Path) -> None:
    """A plausible but wrong figure (another machine's, a stale run's) costs one recomputed hit:
    that hit's own prefill step replaces it, and the next hit loads."""
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"version": 1, "prefill": [[2048, 0.001], [4096, 0.002]]}))
    advisor = _advisor(path=str(path), floor=FLOOR)
    first = advisor.choose(2048, 300 * MB, 1.0)
    assert first is not None and not first.load  # 300 MB at 8 GB/s: 38 ms > 1 ms
    advisor.observe_step(2048, 12.0)  # that hit, recomputed, measured
    again = advisor.choose(4096, 600 * MB, 1.0)
    assert again is not None and again.load  # the 4096 file figure went with the 2048 one
    assert "4096 tok" not in advisor.describe()


def test_a_file_figure_that_agrees_with_this_server_stays() -> None:
    advisor = _advisor(floor=FLOOR)
    advisor._file_prefill = {13: (4096, 25.0)}
    advisor.observe_step(2048, 12.0)
    assert "4096 tok 25000.0 ms" in advisor.describe()


def test_a_hit_recomputed_on_a_bandwidth_from_the_file_is_loaded_every_third_time(tmp_path: Path) -> None:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"version": 1, "prefill": [[2048, 0.050]], "cold_bps": 2e6}))  # 2 MB/s
    advisor = _advisor(path=str(path), floor=FLOOR)
    choices = [advisor.choose(2048, 300 * MB, 0.0) for _ in range(6)]
    assert [c is not None and c.load for c in choices] == [False, False, True, False, False, True]
    advisor.observe_load(300 * MB, 0.220, share=0.0)  # measured here: 1.4 GB/s, still slower
    assert all(c is not None and not c.load for c in (advisor.choose(2048, 300 * MB, 0.0) for _ in range(10)))


def test_a_figure_of_a_new_size_is_kept_at_once(tmp_path: Path) -> None:
    """vLLM's CPU build may kill the engine before its shutdown hooks: what the next start
    decides on is written when measured, not 30 s later."""
    path = tmp_path / "figures.json"
    advisor = _advisor(path=str(path), floor=FLOOR)
    advisor.observe_step(1024, 5.0)
    advisor.save()
    advisor.observe_step(2048, 12.0)
    advisor.save()  # a new size: written although the last write was just now
    assert advisor.written()  # on the figures' own thread, not the engine's
    assert [n for n, _s in json.loads(path.read_text())["prefill"]] == [1024, 2048]
    advisor.observe_step(2048, 13.0)
    advisor.save()  # the same size again: within 30 s, not written
    assert advisor.written()
    assert json.loads(path.read_text())["prefill"][1] == [2048, 12.0]


def test_a_link_or_a_fifo_planted_at_the_figures_files_name_is_neither_followed_nor_waited_on(
        tmp_path: Path) -> None:
    """The store folder is not trusted: the figures file is read and written without following a
    link there (the server's own files stay untouched) and without waiting on a FIFO."""
    outside = tmp_path / "authorized_keys"
    outside.write_text("ssh-ed25519 AAAA... admin\n")
    path = tmp_path / "figures.json"
    path.symlink_to(outside)
    guessed = tmp_path / f"figures.json.tmp-{os.getpid()}"  # a temporary name one could guess
    guessed.symlink_to(outside)
    advisor = _advisor(path=str(path), floor=FLOOR)  # not read through the link
    assert advisor.model() is None
    advisor.observe_step(2048, 12.0)
    advisor.save(force=True)
    assert outside.read_text() == "ssh-ed25519 AAAA... admin\n"
    assert not path.is_symlink() and json.loads(path.read_text())["prefill"] == [[2048, 12.0]]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [guessed.name]  # left as it was
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert _advisor(path=str(fifo)).model() is None  # returns at once: nothing waits for a writer
