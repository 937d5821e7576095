#!/usr/bin/env bash
# The README's first command: install what is needed (into .venv), then run the demo: a small
# local model served by a real vLLM server with Galahad, restarted, answering warm and identical.
# Extra arguments go to the demo (e.g. `--tokens 2000`, `--keep`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m galahad.cli.demo "$@"
