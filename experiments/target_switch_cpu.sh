#!/usr/bin/env bash
# The target switch at CPU scale (seed 0) and its single-target controls, full fine-tune (hybrid)
# first, then per-target LoRA (hybrid_lora). Resumable: a re-run skips finished runs and resumes cut ones.
#   bash experiments/target_switch_cpu.sh && omnidraft tables results/paper/target_switch/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
O=(.venv/bin/omnidraft -m experiment=paper/target_switch scale=cpu seed=0 progress=false)
Q=qwen25_coder_15b
G=gemma3_270m
for ROW in hybrid hybrid_lora; do
  "${O[@]}" row=$ROW                                                  # Q > G > Q > G
  "${O[@]}" row=$ROW "target_switch.targets=[$Q,$Q,$Q,$Q]"             # control: Q throughout
  "${O[@]}" row=$ROW target=$G "target_switch.targets=[$G,$G,$G,$G]"   # control: G throughout
done
