#!/bin/bash
# Issue 5's draft-length policies compared for speed in ONE process on the same prompts
# (conf/bench_suite/adaptive.yaml): ar vs the same adapted same-vocab drafter (Qwen2.5-Coder-0.5B
# for Qwen2.5-Coder-1.5B, fp32, 64 new tokens like the streams) served frozen with fixed k=5, the
# +2/-1 heuristic and the acceptance head at gamma 0.7 (GSM8K preset) and 0.5; GSM8K test prompts
# 400..419. STATE: an adaptive stream's state (LoRA + head), e.g. the sv_interleaved stream's.
#   RUNS_ROOT=/work/runs bash experiments/run_adaptive_bench.sh /work/runs/adaptive/sv_interleaved/state 0,1
# Resumes from its per-prompt checkpoint when run again; writes results/adaptive/bench_policies.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
state=$1; core=${2:-0,1}
root=${RUNS_ROOT:-results}
dir=$root/adaptive/bench_policies
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline}
resume=false
[ -f "$dir/state/bench.json" ] && resume=true
threads=$(echo "$core" | tr ',' '\n' | wc -l)
over=()
for v in fixed_k5 heuristic head head_g05; do
  over+=("+bench.method_overrides.$v=[\"drafter.init_state=$state\"]")
done
OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads taskset -c "$core" .venv/bin/omnidraft bench +bench_suite=adaptive \
  drafter=qwen25_coder_05b target.dtype=float32 drafter.dtype=float32 decode.max_new_tokens=64 \
  threads=$threads logger=none resume=$resume hydra.run.dir="$dir" "${over[@]}"
bash experiments/copy_results.sh "$root" adaptive/bench_policies
