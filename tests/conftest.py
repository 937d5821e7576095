"""Test settings shared by every suite.

- Hypothesis profiles `dev` (default), `ci` and `nightly`, chosen by `HYPOTHESIS_PROFILE`.
- Tests marked `slow` run only with `--run-slow` or `GALAHAD_SLOW=1`.
- Tests marked `gpu` run only where torch sees CUDA.
"""

from __future__ import annotations

import datetime as dt
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=dt.timedelta(seconds=2))
settings.register_profile(
    "ci",
    max_examples=300,
    deadline=dt.timedelta(seconds=5),
    derandomize=True,  # reproducible on every CI run; the nightly profile explores
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def _slow_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--run-slow")) or os.environ.get("GALAHAD_SLOW", "") == "1"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = None if _slow_enabled(config) else pytest.mark.skip(reason="slow: use --run-slow or GALAHAD_SLOW=1")
    needs_gpu = any("gpu" in item.keywords for item in items)
    skip_gpu = None
    if needs_gpu and not _cuda_available():  # import torch only when a gpu test was collected
        skip_gpu = pytest.mark.skip(reason="gpu: torch.cuda is not available")
    for item in items:
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
