"""What `open_cache` says at startup, line by line, for what an operator greps: each refusal
once (the `NOT CACHING` warning), the licence's own line only when it is valid."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from galahad.bootstrap import open_cache
from galahad.config import Settings, read_settings
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from vllm_support.licence import make_licence

NS = Namespace(model="startup-lines", model_fingerprint="startup-lines", dtype="float32",
               kv_cache_dtype="auto", block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 2),),
               payload_order=PayloadOrder.LAYER)


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_refused_licence_is_said_once_by_the_not_caching_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It used to be said twice: at INFO by the licence line, then by the NOT CACHING warning."""
    caplog.set_level(logging.INFO, logger="galahad")
    handle = open_cache(read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"),
                                       "GALAHAD_LICENCE_FILE": str(tmp_path / "none.lic")}), NS, RankLayout())
    assert handle.service is None
    said = _messages(caplog, "licence refused")
    assert len(said) == 1 and said[0].startswith("[galahad] NOT CACHING: licence refused (missing)"), said


def test_a_valid_licence_is_said_once_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="galahad")
    lic, pub = make_licence(tmp_path / "lic")
    handle = open_cache(read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
                                       "GALAHAD_LICENCE_ISSUER_KEY": pub}), NS, RankLayout())
    assert handle.service is not None, handle.reason
    assert len(_messages(caplog, "licence OK")) == 1 and not _messages(caplog, "NOT CACHING")
    handle.service.close()


def test_a_relative_store_folder_is_warned_of_once_naming_where_it_was_taken(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit file's or a container's working folder is not the shell's: a relative
    GALAHAD_CACHE_DIR finds no store after a restart from elsewhere ("no hits after a restart")."""
    caplog.set_level(logging.INFO, logger="galahad")
    monkeypatch.chdir(tmp_path)
    lic, pub = make_licence(tmp_path / "lic")
    handle = open_cache(read_settings({"GALAHAD_CACHE_DIR": "store", "GALAHAD_LICENCE_FILE": lic,
                                       "GALAHAD_LICENCE_ISSUER_KEY": pub}), NS, RankLayout())
    assert handle.service is not None, handle.reason
    said = _messages(caplog, "relative path")
    assert said == [f"[galahad] GALAHAD_CACHE_DIR='store' is a relative path, taken as {tmp_path / 'store'} from "
                    "the folder this server started in; a restart from another folder would not find it: set "
                    "GALAHAD_CACHE_DIR to the absolute path"], said
    assert _messages(caplog, f"store {tmp_path / 'store'}")
    handle.service.close()
    caplog.clear()
    again = open_cache(read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
                                      "GALAHAD_LICENCE_ISSUER_KEY": pub}), NS, RankLayout())
    assert again.service is not None and not _messages(caplog, "relative path")
    again.service.close()


def test_data_parallel_engines_count_for_the_licence_points(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A point covers one GPU rank of the whole deployment: tensor x pipeline x data parallel.
    Each data-parallel engine opens its own cache for tp x pp ranks; two engines of tp 2 use four
    GPUs, so a two-point licence is refused in each of them and a four-point one allowed."""
    caplog.set_level(logging.INFO, logger="galahad")
    two, pub = make_licence(tmp_path / "lic", points=2, name="two.lic")
    four, _ = make_licence(tmp_path / "lic", points=4, name="four.lic")
    layout = RankLayout(tp_size=2, dp_size=2)
    assert (layout.world_size, layout.gpu_ranks) == (2, 4)  # entries still have parts for 2 ranks

    def settings(lic: str) -> Settings:
        return read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
                              "GALAHAD_LICENCE_ISSUER_KEY": pub})

    refused = open_cache(settings(two), NS, layout)
    assert refused.service is None
    assert refused.reason == (f"licence refused (too few points): no licence for 4 GPU ranks: licence {two} "
                              "covers 2 GPU ranks and this server uses 4 (tensor x pipeline x data parallel); "
                              "ask for a licence of at least 4 points, or run on fewer GPUs"), refused.reason
    allowed = open_cache(settings(four), NS, layout)
    assert allowed.service is not None, allowed.reason
    assert _messages(caplog, "tp 2 x pp 1 x dp 2")  # the namespace line names the data-parallel engines
    allowed.service.close()
