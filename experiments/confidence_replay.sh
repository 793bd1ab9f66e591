#!/usr/bin/env bash
# Issue 30 in replay: the drafter LM's confidence stop (method.draft_length.policy=confidence, stop
# after a drafted token whose drafter probability < min_prob) against the fixed length, for
# omnidraft_pl (prompt lookup consulted first, the drafter LM's k=5 otherwise), on the first 20 test prompts of a
# task (64 new tokens, fp32, greedy), the drafter untrained and frozen (the n-gram cache still learns).
# Acceptance and tokens per step are exact (replay); speed is modelled from this machine's calibration.
#   bash experiments/confidence_replay.sh gsm8k; bash experiments/confidence_replay.sh mbpp_humaneval
#   omnidraft tables results/lookup/replay/<task>/confidence
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:?usage: confidence_replay.sh gsm8k|mbpp_humaneval}
export OMP_NUM_THREADS=1
C=(engine=replay task="$TASK" task.limit=20 decode.max_new_tokens=64 target.dtype=float32 drafter.dtype=float32
   threads=1 progress=false method.adapt.enabled=false logger=none)
O=results/lookup/replay/$TASK/confidence
.venv/bin/omnidraft -m method=omnidraft_pl method.draft_length.policy=confidence \
  method.draft_length.min_prob=0.3,0.5,0.7 "${C[@]}" hydra.sweep.dir="$O"
.venv/bin/omnidraft -m method=omnidraft_pl method.draft_length.policy=fixed "${C[@]}" hydra.sweep.dir="$O/fixed"
