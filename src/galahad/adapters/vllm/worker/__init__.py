"""Worker side of the connector: copy prompt blocks out for saving, load verified parts in
(`core.GalahadWorker`; its parts: `saves`, `loads`, `pending`, `readahead`)."""

from galahad.adapters.vllm.worker.core import GalahadWorker

__all__ = ["GalahadWorker"]
