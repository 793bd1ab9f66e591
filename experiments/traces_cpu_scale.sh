#!/usr/bin/env bash
# Target traces of the default target (Qwen2.5-Coder-1.5B, fp32, 64 new tokens) for the paper
# experiments at scale=cpu (50 test + 100 train prompts per task), then the issue-28 sizes (the
# paper's test sets + 400 train prompts). Two chains, one per core; each `omnidraft trace` resumes
# where a cut run stopped, so run the same chain again to continue.
#   bash experiments/traces_cpu_scale.sh a   # MBPP+HE train, Alpaca sample, then the larger slices
#   bash experiments/traces_cpu_scale.sh b   # XSum test and train, Alpaca test, then the larger slices
#   bash experiments/traces_cpu_scale.sh c   # Table 3's second target, Qwen2.5-Coder-0.5B: GSM8K, MBPP+HE
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
XSUM=${OMNIDRAFT_XSUM:-../shared/data/xsum/test.jsonl}
# TRACE_BATCH prompts per forward (trace.batch_size; lines traced before it existed were decoded one by one)
T=(.venv/bin/omnidraft trace decode.max_new_tokens=64 target.dtype=float32 threads=1 progress=false
   trace.batch_size="${TRACE_BATCH:-16}")
case "${1:?chain a, b or c}" in
  a)
    "${T[@]}" task=mbpp_humaneval task.offset=228 task.limit=100
    "${T[@]}" task=alpaca_sample task.limit=100
    "${T[@]}" task=gsm8k task.offset=200 task.limit=400
    "${T[@]}" task=mbpp_humaneval task.limit=228
    "${T[@]}" task=mbpp_humaneval task.offset=228 task.limit=400
    "${T[@]}" task=alpaca_sample task.limit=400
    ;;
  b)
    "${T[@]}" task=xsum paths.xsum="$XSUM" task.limit=50
    "${T[@]}" task=xsum paths.xsum="$XSUM" task.offset=100 task.limit=100
    "${T[@]}" task=alpaca task.limit=50
    "${T[@]}" task=alpaca task.limit=100
    "${T[@]}" task=xsum paths.xsum="$XSUM" task.limit=100
    "${T[@]}" task=xsum paths.xsum="$XSUM" task.offset=100 task.limit=400
    ;;
  c)
    "${T[@]}" target=qwen25_coder_05b task=gsm8k task.limit=50
    "${T[@]}" target=qwen25_coder_05b task=gsm8k task.offset=200 task.limit=100
    "${T[@]}" target=qwen25_coder_05b task=mbpp_humaneval task.limit=50
    "${T[@]}" target=qwen25_coder_05b task=mbpp_humaneval task.offset=228 task.limit=100
    ;;
esac
