#!/usr/bin/env bash
# The target switch at CPU scale: per seed, from each target (Qwen2.5-Coder-1.5B, Gemma-3-270M) the stream
# that switches to the other and back every 25 prompts, and that target's control stream (stay), full
# fine-tune (hybrid); then the per-target LoRA row (hybrid_lora). Resumable: a re-run skips finished runs
# and resumes cut ones.
#   bash experiments/target_switch_cpu.sh [SEEDS] && omnidraft tables results/paper/target_switch/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
SEEDS=${1:-0,1,2}
.venv/bin/omnidraft -m experiment=paper/target_switch scale=cpu seed="$SEEDS" progress=false
.venv/bin/omnidraft -m experiment=paper/target_switch scale=cpu seed="$SEEDS" row=hybrid_lora progress=false
