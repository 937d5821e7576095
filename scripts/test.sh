#!/usr/bin/env bash
# The README's test command: install what is needed, check the layering, run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not vllm"`, `--run-slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VPY=.venv/bin/python
echo "[test] import contracts (lint-imports)" >&2
.venv/bin/lint-imports
echo "[test] types (mypy strict on domain, ports, format, config)" >&2
.venv/bin/mypy
echo "[test] pytest" >&2
exec "$VPY" -m pytest -q "$@"
