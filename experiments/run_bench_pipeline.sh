#!/bin/bash
# Issue 6's bench end to end on the default pair; every stage resumes, so run it again after an
# interruption (same RUNS_ROOT, same machine) and it continues where it stopped.
#   1. DistillSpec checkpoint: GSM8K test prompts 200..263, on-policy drafter data, forward KL
#      (core 1, one thread)                                     -> $root/distill/gsm8k_fkl/
#   2. omnidraft warm-up: the core issue's stream again (GSM8K test prompts 0..199, 64 new tokens),
#      without the ar baseline (core 0, one thread, in parallel) -> $root/bench_warmup/omnidraft/
#   3. the bench: every method, 128 new tokens, one process per task (GSM8K 400..419 on core 0,
#      HumanEval 0..19 on core 1, one thread each; all methods of a task in ONE process, interleaved
#      per prompt), checkpointed every prompt -> $root/bench/runs/{gsm8k,humaneval}/; then results/bench/table.md
#   Stage 2 single-threaded takes ~80 min on an AVX512-BF16 core; once stage 1 is done (~15 min) you
#   may stop it (SIGTERM) and resume it on both cores, which the pipeline does not do for you:
#     taskset -c 0,1 .venv/bin/omnidraft method=omnidraft measure_baseline=false task.limit=200 \
#       decode.max_new_tokens=64 baseline_every=5 threads=2 checkpoint_every=5 logger=none resume=true \
#       hydra.run.dir=$root/bench_warmup/omnidraft
#   RUNS_ROOT=/work/runs bash experiments/run_bench_pipeline.sh
# RUNS_ROOT (default results) holds the run directories; their state/ folders are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${RUNS_ROOT:-results}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline}
distill=$root/distill/gsm8k_fkl
warm=$root/bench_warmup/omnidraft
finished() { [ -f "$1/summary.json" ] && grep -q '"status": "ok"' "$1/summary.json"; }

if ! finished "$distill"; then
  resume=false; [ -d "$distill/data" ] && resume=true
  OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/omnidraft distill task.limit=64 threads=1 logger=none \
    resume=$resume hydra.run.dir="$distill" &
fi
if ! finished "$warm"; then
  RUNS_ROOT=$root bash experiments/run_stream.sh bench_warmup omnidraft 0 method=omnidraft measure_baseline=false &
fi
wait
finished "$distill" && finished "$warm" || { echo "a preparation stage failed; see its summary.json" >&2; exit 1; }

bench() {  # TASK CORE
  local dir=$root/bench/runs/$1 resume=false
  [ -f "$dir/state/bench.json" ] && resume=true  # a finished bench resumed only rewrites its outputs
  OMP_NUM_THREADS=1 taskset -c "$2" .venv/bin/omnidraft bench "bench.tasks=[$1]" threads=1 logger=none \
    resume=$resume hydra.run.dir="$dir" \
    "bench.method_overrides.omnidraft=[\"drafter.init_state=$warm/state\",\"drafter.init_ngram=true\"]" \
    "bench.method_overrides.distillspec=[\"drafter.init_state=$distill/state\"]"
}
bench gsm8k 0 &
bench humaneval 1 &
wait
bash experiments/copy_results.sh "$root" distill/gsm8k_fkl bench_warmup/omnidraft bench/runs/gsm8k bench/runs/humaneval
.venv/bin/omnidraft tables bench
