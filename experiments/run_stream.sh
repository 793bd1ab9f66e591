#!/bin/bash
# Run, or resume after an interruption, one 200-prompt GSM8K stream (64 new tokens, ar on every
# 5th prompt, checkpoint every 5 prompts), pinned to one CPU core with one thread, so that two
# streams share a 2-core machine without thrashing.
#   bash experiments/run_stream.sh GROUP NAME CORE [overrides...]    -> results/GROUP/NAME/
#   bash experiments/run_stream.sh core spd_dm 0 method=spd_dm               (issue 3)
#   bash experiments/run_stream.sh adaptive sv_joint 1 drafter=qwen25_coder_05b ablation=adaptive_joint  (issue 5)
# Writes summary.json, config.yaml, metrics.jsonl; state/ is the checkpoint (git-ignored).
# RUNS_ROOT=DIR runs in DIR/GROUP/NAME instead of results/GROUP/NAME (e.g. a disk that outlives the
# checkout, for a stream resumed across sessions); copy its files into results/ when it is done.
# CORE may be a list ("0,1"): the stream then runs with one thread per listed core (one stream alone
# on the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
group=$1; name=$2; core=$3; shift 3
dir=${RUNS_ROOT:-results}/$group/$name
mkdir -p "$dir"
exec 9>"$dir/.lock"  # held by the run for its lifetime: a second start of the same stream is refused
flock -n 9 || { echo "run_stream.sh: $dir is already being run by another process; wait for it" >&2; exit 1; }
resume=false
[ -f "$dir/state/meta.json" ] && resume=true
threads=$(echo "$core" | tr ',' '\n' | wc -l)
OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads exec taskset -c "$core" .venv/bin/omnidraft "$@" task.limit=200 \
  decode.max_new_tokens=64 baseline_every=5 threads=$threads checkpoint_every=5 logger=none resume=$resume \
  hydra.run.dir="$dir"
