#!/bin/bash
# Issue 6's bench end to end on the default pair; every stage resumes, so run it again after an
# interruption (same RUNS_ROOT, same machine) and it continues where it stopped.
#   1. DistillSpec checkpoint: GSM8K test prompts 200..263, on-policy drafter data, forward KL
#      (core 1, one thread)                                     -> $root/distill/gsm8k_fkl/
#   2. omnidraft warm-up: the core issue's stream again (GSM8K test prompts 0..199, 64 new tokens),
#      without the ar baseline (core 0, one thread, in parallel) -> $root/bench_warmup/omnidraft/
#   3. the bench: every method, GSM8K 400..419 + HumanEval 0..19, 128 new tokens, one process on
#      both cores, checkpointed every prompt                    -> $root/bench/run/ and results/bench/
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

bench=$root/bench/run
resume=false; [ -f "$bench/state/bench.json" ] && resume=true
exec .venv/bin/omnidraft bench threads=2 logger=none resume=$resume hydra.run.dir="$bench" \
  "bench.method_overrides.omnidraft=[\"drafter.init_state=$warm/state\",\"drafter.init_ngram=true\"]" \
  "bench.method_overrides.distillspec=[\"drafter.init_state=$distill/state\"]"
