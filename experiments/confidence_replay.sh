#!/usr/bin/env bash
# Issue 30 in replay: the drafter LM's confidence stop (method.draft_length.policy=confidence, stop
# after a drafted token whose drafter probability < min_prob) against the fixed length, for
# omnidraft_pl (prompt lookup consulted first, the drafter LM's k=5 otherwise), on 20 test prompts of a
# task (64 new tokens, fp32, greedy), the drafter frozen (the n-gram cache still learns).
# Acceptance and tokens per step are exact (replay); speed is modelled from this machine's calibration.
#   bash experiments/confidence_replay.sh gsm8k; bash experiments/confidence_replay.sh mbpp_humaneval
#   omnidraft tables results/lookup/replay/<task>/confidence
# Env: MIN_PROBS (default 0.3,0.5,0.7), OUT (default results/lookup/replay/<task>/confidence); extra
# arguments are overrides for every run. The threshold of omnidraft_pl (session 23) came from the bench's
# warm state, held-out prompts and a bf16 target's calibration (verification width nearly free there):
#   w=results/bench_warmup/mixed_mbpp100_gsm8k60/state
#   cal=results/calibration/qwen25_coder_15b-smollm2_135m/intel-xeon-processor-amx_bfloat16-target_float32-drafter_1t.json
#   for t in gsm8k mbpp_humaneval; do
#     off=0; [ $t = mbpp_humaneval ] && off=20  # clear of the bench's HumanEval 0..19
#     OUT=results/lookup/replay/$t/confidence_warm MIN_PROBS=0.5,0.7,0.85,0.95 bash experiments/confidence_replay.sh $t \
#       task.offset=$off "drafter.init_state='$w'" drafter.init_ngram=true replay.speed_target_dtype=bfloat16 replay.calibration=$cal
#   done
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:?usage: confidence_replay.sh gsm8k|mbpp_humaneval [overrides...]}
shift
export OMP_NUM_THREADS=1
C=(engine=replay task="$TASK" task.limit=20 decode.max_new_tokens=64 target.dtype=float32 drafter.dtype=float32
   threads=1 progress=false method.adapt.enabled=false logger=none "$@")
O=${OUT:-results/lookup/replay/$TASK/confidence}
.venv/bin/omnidraft -m method=omnidraft_pl method.draft_length.policy=confidence \
  method.draft_length.min_prob="${MIN_PROBS:-0.3,0.5,0.7}" "${C[@]}" hydra.sweep.dir="$O"
.venv/bin/omnidraft -m method=omnidraft_pl method.draft_length.policy=fixed "${C[@]}" hydra.sweep.dir="$O/fixed"
