#!/bin/bash
# Issue 5's same-vocab streams (Qwen2.5-Coder-0.5B drafting for 1.5B, LoRA r32 distillation, 200
# GSM8K prompts each), two at a time, one chain per core: sv_fixed then sv_heuristic on core 0,
# sv_joint then sv_interleaved on core 1 (a core never idles waiting for the other); then their
# files are copied into results/adaptive/ and the table is rebuilt.
# Every stream checkpoints every 5 prompts and resumes, so run this again after an interruption
# (same RUNS_ROOT, same machine) and it continues; finished streams are skipped.
#   RUNS_ROOT=/work/runs bash experiments/run_adaptive_pipeline.sh
# ~3.3 h a stream on one core of an AVX512 CPU without native bf16 (fp32), both cores busy.
# A stream already finished in RUNS_ROOT or in results/adaptive/ (committed) is skipped. To run
# one stream alone on both cores (two threads), e.g. in a session too short for two in parallel:
#   RUNS_ROOT=/work/runs bash experiments/run_stream.sh adaptive sv_heuristic 0,1 drafter=qwen25_coder_05b \
#     method=omnidraft method.adapt.lora_rank=32 target.dtype=float32 drafter.dtype=float32 ablation=heuristic_k
set -euo pipefail
cd "$(dirname "$0")/.."
root=${RUNS_ROOT:-results}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline}
# fp32 on every machine: sv_fixed and sv_joint ran fp32 (`auto` on a CPU without native bf16),
# and bf16's batched verification is not token-equal to ar (results/core: 0.825 of prompts)
sv=(drafter=qwen25_coder_05b method=omnidraft method.adapt.lora_rank=32 target.dtype=float32 drafter.dtype=float32)
done_in() { [ -f "$1/summary.json" ] && grep -q '"status": "ok"' "$1/summary.json"; }
finished() { done_in "$root/adaptive/$1" || done_in "results/adaptive/$1"; }  # committed ones count
stream() {  # NAME CORE [overrides...]
  local name=$1; shift
  finished "$name" || RUNS_ROOT=$root bash experiments/run_stream.sh adaptive "$name" "$@"
}
{ stream sv_fixed 0 "${sv[@]}"; stream sv_heuristic 0 "${sv[@]}" ablation=heuristic_k; } &
{ stream sv_joint 1 "${sv[@]}" ablation=adaptive_joint
  stream sv_interleaved 1 "${sv[@]}" ablation=adaptive_interleaved; } &
wait
bash experiments/copy_results.sh "$root" adaptive/sv_fixed adaptive/sv_joint adaptive/sv_heuristic adaptive/sv_interleaved
.venv/bin/omnidraft tables adaptive
