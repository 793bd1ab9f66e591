#!/usr/bin/env bash
# Issue 30 in replay: the paper's omnidraft (fixed k=5) against omnidraft_pl (prompt lookup consulted
# first) and pld, with fixed and cost-aware (method.draft_length.policy=cost) draft lengths, on the
# first 20 GSM8K and 20 HumanEval test prompts (64 new tokens, fp32, greedy), the drafter untrained and
# frozen (the n-gram cache still learns). Speed is modelled from this machine's latency calibration
# (omnidraft calibrate target.dtype=float32 drafter.dtype=float32 threads=1). One task per core:
#   bash experiments/lookup_replay.sh gsm8k & bash experiments/lookup_replay.sh mbpp_humaneval; wait
#   omnidraft tables results/lookup/replay/gsm8k; omnidraft tables results/lookup/replay/mbpp_humaneval
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:?usage: lookup_replay.sh gsm8k|mbpp_humaneval}
export OMP_NUM_THREADS=1
C=(engine=replay task="$TASK" task.limit=20 decode.max_new_tokens=64 target.dtype=float32 threads=1 progress=false)
O=results/lookup/replay/$TASK
.venv/bin/omnidraft -m method=omnidraft,omnidraft_pl method.draft_length.policy=fixed,cost drafter.dtype=float32 \
  method.adapt.enabled=false "${C[@]}" hydra.sweep.dir="$O/model"
.venv/bin/omnidraft -m method=pld method.k=5,12 "${C[@]}" hydra.sweep.dir="$O/pld"
