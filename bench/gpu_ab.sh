#!/usr/bin/env bash
# One bench mode with different source trees, in turns, in one lease (side by side: the same
# machine, the same minutes). Two steps:
#   here:       bash bench/gpu_ab.sh prepare NAME COMMIT [PATCH]
#               .gpugal/ab/NAME/src is COMMIT's src/, with PATCH (a `git diff` of src/) applied
#   the lease:  AMODES= GPUTESTS=0 BMODES=none THEN='bash bench/gpu_ab.sh run off:cur cur NAME ...' \
#                 bash bench/gpu_lease.sh          (carry .gpuvllm and .gpugal)
# Each item of `run` is TREE or off:TREE; TREE is `cur` (this checkout's src/) or a prepared NAME.
# An item runs AB_MODE (default turns-on), off:TREE runs turns-off, each as `bench/gpu.py all` with
# LENS (2048) into /tmp/gbench; $OUT/variants.txt names the tree of each run, in order.
set -uo pipefail
case "${1:-}" in
  prepare)
    name=$2 commit=$3 patch=${4:-}
    rm -rf ".gpugal/ab/$name" && mkdir -p ".gpugal/ab/$name" || exit 1
    git archive "$commit" src | tar -x -C ".gpugal/ab/$name" || exit 1
    if [ -n "$patch" ]; then git apply --directory=".gpugal/ab/$name" "$patch" || exit 1; fi
    echo "prepared .gpugal/ab/$name/src from $commit${patch:+ with $patch}" ;;
  run)
    shift
    W=/tmp/gbench OUT=${OUT:-/tmp/gpugal_out}
    for item in "$@"; do
      mode=${AB_MODE:-turns-on} tree=$item
      case $item in off:*) mode=turns-off tree=${item#off:} ;; esac
      src=$PWD/src; [ "$tree" != cur ] && src=$PWD/.gpugal/ab/$tree/src
      [ -d "$src" ] || { echo "no tree $tree: run 'bash bench/gpu_ab.sh prepare $tree COMMIT' first"; exit 2; }
      echo "### $mode $tree" | tee -a "$OUT/variants.txt"
      PYTHONPATH=/tmp/site:$src:$PWD/tests/integration OUT=/tmp/gpugal_logs timeout 150 \
        python3 bench/gpu.py all $W --lens "${LENS:-2048}" --modes "$mode" 2>&1 \
        | grep -E '"round_|"load_jobs"|"turns"|^=== ' | cut -c1-200
      cp $W/results.jsonl "$OUT/" 2>/dev/null
    done ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
