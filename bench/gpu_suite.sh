#!/usr/bin/env bash
# The GPU suite on a machine with one H200, from the repo root: bash bench/gpu_suite.sh
# It installs the trimmed vLLM and the wheels it needs from .gpuvllm/ and .gpugal/whl/ (the cp312
# wheels of cryptography, cffi, pycparser, construct and pycryptodome; docs/benchmarks.md, "GPU"),
# runs the GPU tests beside the stores being written (untimed), then bench/gpu.py's timed modes
# with the GPU to themselves, and ends with bench/gpu.py's report, whose last line is the
# `gpu-bench:` ratio line (bench/gpu.py's docstring says what each ratio means).
# Everything goes to $OUT (default bench/out/gpu-suite-<YYYYmmdd-HHMMSS>): results.jsonl, the plot,
# logs/ (each mode's log, the GPU tests' log) and restart.json (the GPU restart tests' figures);
# the stores go to /tmp/gbench. Settings (environment):
#   LENS      prompt lengths, tokens (default 2048,8192,32768)
#   AMODES    the stores, written side by side before the timed modes, untimed
#             (default store-plain,store-sealed,store-fs)
#   GPUTESTS  1 (default): run the GPU tests beside the stores; 0: skip them
#   GPUTESTPATHS  the test paths (default tests/gpu tests/integration/test_vllm_worker_reads.py)
#   GPUTESTS_S    their time limit, seconds (default 420)
#   BMODES    the timed modes, in order (none: no timed modes)
#   TOTAL_S   seconds the whole suite may take (default 570): the timed modes get what is left
#   FIRST     a command run before the stores; THEN: a command run after the timed modes
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-bench/out/gpu-suite-$(date +%Y%m%d-%H%M%S)}
LOGS=$OUT/logs; mkdir -p "$LOGS"
echo "output folder: $OUT"
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  mkdir -p /tmp/site
  tar -xJf .gpuvllm/vllm-trim.tar.xz -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuvllm/whl/*.whl .gpugal/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests/integration PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 GALAHAD_TEST_MODEL_CACHE=/tmp/models
echo "install_s=$(( $(date +%s) - T0 ))"
LENS=${LENS:-2048,8192,32768}
W=/tmp/gbench; mkdir -p $W
if [ -n "${FIRST:-}" ]; then eval "$FIRST"; fi
# untimed, in parallel: the GPU tests and the stores
P2=""
if [ "${GPUTESTS:-1}" = 1 ]; then
  # a run cut short by its limit leaves no engine behind to slow the timed modes
  ( GALAHAD_GPU_RESULTS=$OUT/restart.json timeout ${GPUTESTS_S:-420} python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/gtr ${GPUTESTPATHS:-tests/gpu tests/integration/test_vllm_worker_reads.py} > $LOGS/pytest-gpu.log 2>&1; echo "pytest-gpu rc=$?" >> $LOGS/pytest-gpu.log; pkill -9 -f -- "--basetemp=/tmp/gtr"; pkill -9 -f vllm_runner; true ) &
  P2=$!
fi
PIDS=""; n=0
for m in $(echo "${AMODES-store-plain,store-sealed,store-fs}" | tr , ' '); do
  n=$((n+1)); timeout 280 python3 bench/gpu.py $m --out $OUT --store $W --lens $LENS > $LOGS/$m.log 2>&1 &
  PIDS="$PIDS $!"; [ $n = 1 ] && sleep 20
done
[ -n "$PIDS" ] && wait $PIDS
echo "stores done at $(( $(date +%s) - T0 )) s"; cat $LOGS/store-*.log 2>/dev/null | grep '^RESULT' | cut -c1-300
if [ -n "$P2" ]; then wait $P2; tail -25 $LOGS/pytest-gpu.log; fi
# the timed modes run alone: the tests' files go, and they wait (at most 60 s) until no other
# process holds the GPU
rm -rf /tmp/gtr
for i in $(seq 1 60); do
  [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
  sleep 1
done
LEFT=$(( ${TOTAL_S:-570} - ($(date +%s) - T0) ))
if [ "${BMODES:-}" != none ]; then
  python3 bench/gpu.py all --out $OUT --store $W --lens $LENS --deadline-s $(( LEFT - 10 )) \
    --modes ${BMODES:-recompute,gpuhit,load-plain,load-sealed,cold-plain,load-fs,turns-off,turns-on,turns-faulty,turns-slow} \
    | grep --line-buffered -v '^gpu-bench:'
fi
if [ -n "${THEN:-}" ]; then eval "$THEN"; fi
echo "total_s=$(( $(date +%s) - T0 ))"
python3 bench/gpu.py summary --out $OUT | tail -n 1
