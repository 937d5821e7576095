#!/usr/bin/env bash
# One GPU lease, from the repo root: bash bench/gpu_lease.sh (carry .gpuvllm and .gpugal/whl, the
# cp312 wheels of cryptography, cffi, pycparser, construct and pycryptodome: docs/performance.md)
#   AMODES  stores written first, side by side, untimed (default store-plain,store-sealed,store-fs)
#   GPUTESTS=0  skip tests/gpu (run beside the stores; GPUTESTPATHS: other test paths; GPUTESTS_S:
#        their limit, 420 s; 165 tests took 204-281 s in the nineteenth session; a limit that
#        stops them seemed to slow the timed modes after, twenty-first session)
#   BMODES  the timed modes, in order
#   THEN  commands run after them (e.g. another `bench/gpu.py all` with other settings)
#   FIRST  commands run before the stores (e.g. `python3 bench/worker_load.py`); BMODES=none: no timed modes
#   TOTAL_S  seconds the lease may take (default 570); set it below the `run` limit when less
#        device time is left: the timed modes get what is left of it. results.jsonl is copied
#        to $OUT every 10 s, so a lease cut short still returns what it measured
#   SPY  a mode run once more under py-spy (.gpugal/bin/py-spy.gz: docs/performance.md, twelfth
#        session), sampled --native at SPYRATE (100) a second for at most SPY_S (240) seconds;
#        the raw samples (gzipped) and bench/spy.py's summaries of the engine thread under $OUT;
#        SPYWORK=/tmp/gbench for a load mode (reads the stores written before; its figures go to
#        the log only, not results.jsonl). On a fresh machine an engine under py-spy took over 80 s
#        to start at 100 a second, and five 2k loads gave 4 samples at 50 a second: give SPY_S 200+
#        (twenty-third session). A mode name with `~` comes back without its spy files
#   GILSPY  a turns mode run once more, py-spy attached (--gil --nonblocking, 200 a second) for
#        GILSPY_S (9) seconds from the end of its round 0: who holds the interpreter lock in the
#        rounds that load; bench/spy.py's summary and the raw samples (gzipped) under $OUT
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/gpugal_out}; mkdir -p "$OUT"; LOGS=/tmp/gpugal_logs; mkdir -p $LOGS
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  mkdir -p /tmp/site
  tar -xJf .gpuvllm/vllm-trim.tar.xz -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuvllm/whl/*.whl .gpugal/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests/integration PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 GALAHAD_TEST_MODEL_CACHE=/tmp/models
echo "install_s=$(( $(date +%s) - T0 ))"
LENS=${LENS:-2048,8192,32768}
W=/tmp/gbench; mkdir -p $W
( while sleep 10; do cp $W/results.jsonl $OUT/ 2>/dev/null; done ) &
COPIER=$!
trap 'kill $COPIER 2>/dev/null' EXIT
if [ -n "${FIRST:-}" ]; then eval "$FIRST"; fi
# phase A (in parallel, untimed): the GPU tests and the stores
P2=""
if [ "${GPUTESTS:-1}" = 1 ]; then
  # a run cut short by the limit leaves no engine behind (reader processes end with their engine)
  # to slow the timed modes (the nineteenth session's lease 3 ran them beside such leftovers)
  ( GALAHAD_GPU_RESULTS=$OUT/restart.json timeout ${GPUTESTS_S:-420} python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/gtr ${GPUTESTPATHS:-tests/gpu tests/integration/test_vllm_worker_reads.py} > $LOGS/pytest-gpu.log 2>&1; echo "pytest-gpu rc=$?" >> $LOGS/pytest-gpu.log; pkill -9 -f -- "--basetemp=/tmp/gtr"; pkill -9 -f vllm_runner; true ) &
  P2=$!
fi
PIDS=""; n=0
for m in $(echo "${AMODES-store-plain,store-sealed,store-fs}" | tr , ' '); do
  n=$((n+1)); OUT=$LOGS timeout 280 python3 bench/gpu.py all $W --lens $LENS --modes $m > $LOGS/a$n.txt 2>&1 &
  PIDS="$PIDS $!"; [ $n = 1 ] && sleep 20
done
[ -n "$PIDS" ] && wait $PIDS
echo "stores done at $(( $(date +%s) - T0 )) s"; cat $LOGS/a*.txt 2>/dev/null | grep -v "^|" | grep -v "^gpu-bench"
if [ -n "$P2" ]; then wait $P2; tail -25 $LOGS/pytest-gpu.log; fi
# nothing of the tests beside the timed modes (the twenty-first session's lease C ran them right
# after tests stopped at their limit, and every mode read at half its rate): their files go, and
# the timed modes wait (at most 60 s) until no other process holds the GPU
rm -rf /tmp/gtr
for i in $(seq 1 60); do
  [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
  sleep 1
done
LEFT=$(( ${TOTAL_S:-570} - ($(date +%s) - T0) ))
[ "${BMODES:-}" != none ] && OUT=$LOGS python3 bench/gpu.py all $W --lens $LENS --deadline-s $(( LEFT - 10 )) --modes ${BMODES:-recompute,load-plain,load-plainsync,load-sealed,cold-plain,load-fs,turns-off,turns-on,turns-faulty}
cp $W/results.jsonl $OUT/ 2>/dev/null  # kept even if THEN runs past the limit
if [ -n "${SPY:-}" ] && gunzip -kf .gpugal/bin/py-spy.gz && chmod +x .gpugal/bin/py-spy; then
  # the mode itself, not `all` (py-spy does not follow its child processes here); the python it
  # runs is killed afterwards, so an engine cut short never keeps the GPU for what follows
  SW=${SPYWORK:-/tmp/gbspy}  # SPYWORK=/tmp/gbench: a load mode reads the stores written before
  [ "$SW" = /tmp/gbspy ] && rm -rf /tmp/gbspy; mkdir -p $SW
  timeout -s INT ${SPY_S:-240} .gpugal/bin/py-spy record --threads --native -r ${SPYRATE:-100} -f raw \
    -o /tmp/spy-$SPY.txt -- python3 bench/gpu.py $SPY $SW --lens $LENS > $LOGS/spy-$SPY.log 2>&1
  pkill -f "bench/gpu.py $SPY $SW" 2>/dev/null; sleep 2
  grep '^RESULT' $LOGS/spy-$SPY.log | grep -h '"round_\|"hooks_\|thread_cpu\|"warm_' | cut -c1-300
  for h in wait_for_save start_load_kv get_num_new_matched_tokens; do
    python3 bench/spy.py /tmp/spy-$SPY.txt --only MainThread --under $h --inner galahad/ --top 15
  done > $OUT/spy-$SPY-summary.txt 2>&1
  head -60 $OUT/spy-$SPY-summary.txt | cut -c1-220
  gzip -c /tmp/spy-$SPY.txt > $OUT/spy-$SPY.txt.gz 2>/dev/null
fi
if [ -n "${GILSPY:-}" ] && gunzip -kf .gpugal/bin/py-spy.gz && chmod +x .gpugal/bin/py-spy; then
  rm -rf /tmp/gbgil; mkdir -p /tmp/gbgil
  python3 bench/gpu.py $GILSPY /tmp/gbgil --lens $LENS > $LOGS/gilspy-$GILSPY.log 2>&1 &
  BP=$!
  for i in $(seq 1 400); do grep -q '"round_0"' $LOGS/gilspy-$GILSPY.log && break; sleep 0.5; done
  timeout -s INT ${GILSPY_S:-9} .gpugal/bin/py-spy record --gil --threads --nonblocking -r 200 -f raw \
    -o /tmp/gil-$GILSPY.txt --pid $BP > $LOGS/gilspy-record.log 2>&1
  wait $BP
  grep -h '"round_\|"load_jobs"' $LOGS/gilspy-$GILSPY.log | cut -c1-300
  gzip -c /tmp/gil-$GILSPY.txt > $OUT/gil-$GILSPY.txt.gz 2>/dev/null
  python3 bench/spy.py /tmp/gil-$GILSPY.txt --top 25 > $OUT/gil-$GILSPY-summary.txt 2>&1
  head -120 $OUT/gil-$GILSPY-summary.txt | cut -c1-200
fi
if [ -n "${THEN:-}" ]; then eval "$THEN"; fi  # more commands, with this lease's environment
cp $W/results.jsonl $OUT/ 2>/dev/null
tar -czf $OUT/logs.tgz -C $LOGS . 2>/dev/null
echo "total_s=$(( $(date +%s) - T0 ))"
