"""One offline vLLM process of a test scenario: its own store, key, counters and answers.

Scenarios of a module run two at a time on separate cores (one OpenMP thread each: the same
numerics as one at a time); a restart scenario starts from a copy of another's store and key.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_support.harness import GalahadEnv, block_files, flip_bytes, run_offline

__all__ = ["Scenario", "copy_store", "together"]


class Scenario:
    """Ask `prompts` (then `extra`, as a second phase) of one offline vLLM process."""

    def __init__(self, root: Path, name: str, *, prompts: list[list[int]], max_tokens: int,
                 kv: dict[str, Any] | None, core: str, llm: dict[str, Any] | None = None,
                 key_file: str | None = None, extra: list[list[int]] | None = None,
                 **settings: str) -> None:
        more = {"GALAHAD_KEY_FILE": key_file} if key_file else {}
        self.name, self.kv, self.llm = name, kv, llm or {}
        self.prompts, self.extra, self.max_tokens = prompts, extra or [], max_tokens
        self.env = GalahadEnv(root / name, VLLM_CPU_OMP_THREADS_BIND=core, **more, **settings)
        self.result: dict[str, Any] = {}
        self.note: int = 0  # what a fixture did to this scenario's store (e.g. bytes damaged)

    @property
    def store(self) -> Path:
        return Path(self.env.vars["GALAHAD_CACHE_DIR"])

    @property
    def key_file(self) -> str:
        return self.env.vars["GALAHAD_KEY_FILE"]

    def run(self, model: str) -> Scenario:
        phases = [self._phase(self.prompts)] + ([self._phase(self.extra)] if self.extra else [])
        self.result = run_offline(model, phases, self.env, kv=self.kv, llm=self.llm, name=self.name)
        return self

    def _phase(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return [{"ids": p, "max_tokens": self.max_tokens} for p in prompts]

    def tokens(self, phase: int = 0) -> list[list[int]]:
        return [o["token_ids"] for o in self.result["phases"][phase]]

    def outputs(self, phase: int = 0) -> list[dict[str, Any]]:
        return list(self.result["phases"][phase])

    @property
    def counters(self) -> dict[str, Any]:
        return dict(self.result["counters"][-1])

    @property
    def log(self) -> str:
        return str(self.result["log"])


def together(model: str, *scenarios: Scenario) -> None:
    with ThreadPoolExecutor(len(scenarios)) as pool:
        for future in [pool.submit(s.run, model) for s in scenarios]:
            future.result()


def copy_store(source: Scenario, target: Scenario, *, damage: bool = False) -> None:
    shutil.copytree(source.store, target.store)
    for path in block_files(target.store) if damage else []:
        flip_bytes(path)
