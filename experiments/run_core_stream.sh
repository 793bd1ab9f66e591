#!/bin/bash
# Run, or resume after an interruption, one of issue 3's 200-prompt streams on the default pair,
# pinned to one CPU core with one thread (two streams can share a 2-core machine without thrashing).
#   bash experiments/run_core_stream.sh NAME CORE [overrides...]
#   bash experiments/run_core_stream.sh spd_dm 0 method=spd_dm
#   bash experiments/run_core_stream.sh omnidraft 1 method=omnidraft
# Writes results/core/NAME/ (summary.json, config.yaml, metrics.jsonl; state/ is the checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1; core=$2; shift 2
dir=results/core/$name
resume=false
[ -f "$dir/state/meta.json" ] && resume=true
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 exec taskset -c "$core" .venv/bin/omnidraft "$@" task.limit=200 \
  decode.max_new_tokens=64 baseline_every=5 threads=1 checkpoint_every=5 logger=none resume=$resume \
  hydra.run.dir="$dir"
