#!/usr/bin/env bash
# Issue 30's bench on this machine, end to end; every stage resumes or is skipped when done, so run it
# again after an interruption (same machine: the states are git-ignored).
#   1. warm state (replay, fp32, one core): Table 1's hybrid cell on MBPP's train slice (228..327), then
#      the same drafter adapting on GSM8K train prompts 200..259: a mixed code + math stream, disjoint
#      from the bench's prompts                          -> results/bench_warmup/mixed_mbpp100_gsm8k60/
#   2. the bench (conf/bench_suite/vs_baselines.yaml; dtype auto: bf16 where the CPU has native bf16),
#      one process per task (GSM8K 400..419 on core 0, HumanEval 0..19 on core 1, one thread each; all
#      methods of a task interleaved per prompt), checkpointed every prompt
#                                                        -> results/bench_vs_baselines/<MACHINE>/bench/runs/<task>/
#   3. the table                                         -> results/bench_vs_baselines/<MACHINE>/bench/table.md
# Extra arguments are overrides for every bench method, e.g. the drafter in float32 where this machine's
# calibration says a bf16 drafter forward of 2+ tokens costs ~3x one token (AMX, session 22):
#   MACHINE=intel-xeon-amx_bf16-target_fp32-drafter LIMIT=20 bash experiments/bench_vs_baselines.sh drafter.dtype=float32
set -euo pipefail
cd "$(dirname "$0")/.."
machine=${MACHINE:?name the machine and dtype, e.g. MACHINE=intel-xeon-amx_bf16}
limit=${LIMIT:-20}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline} OMP_NUM_THREADS=1
finished() { [ -f "$1/summary.json" ] && grep -q '"status": "ok"' "$1/summary.json"; }

cell="results/paper/table1/cpu/drafter=smollm2_135m,row=hybrid,seed=0,target=qwen25_coder_15b,task=mbpp_humaneval"
warm=results/bench_warmup/mixed_mbpp100_gsm8k60
if ! finished "$cell" || [ ! -d "$cell/state" ]; then
  .venv/bin/omnidraft -m experiment=paper/table1 scale=cpu task=mbpp_humaneval row=hybrid seed=0
fi
if ! finished "$warm"; then
  resume=false; [ -f "$warm/state/meta.json" ] && resume=true
  .venv/bin/omnidraft method=omnidraft engine=replay task=gsm8k task.offset=200 task.limit=60 \
    target.dtype=float32 drafter.dtype=float32 decode.max_new_tokens=64 threads=1 progress=false \
    "drafter.init_state='$cell/state'" drafter.init_ngram=true logger=none resume=$resume hydra.run.dir="$warm"
fi

extra=("$@")
root=results/bench_vs_baselines/$machine
init="[\"drafter.init_state=$warm/state\",\"drafter.init_ngram=true\"]"
bench() {  # TASK CORE
  local dir=$root/bench/runs/$1 resume=false
  [ -f "$dir/state/bench.json" ] && resume=true
  taskset -c "$2" .venv/bin/omnidraft bench +bench_suite=vs_baselines "bench.tasks=[$1]" bench.limit="$limit" \
    threads=1 logger=none progress=false resume=$resume hydra.run.dir="$dir" bench.out_dir="$root/bench" \
    "bench.method_overrides.omnidraft=$init" "+bench.method_overrides.omnidraft_pl=$init" \
    "+bench.method_overrides.omnidraft_pl_fixed=$init" "${extra[@]}"
}
bench gsm8k 0 &
bench humaneval 1 &
wait
.venv/bin/omnidraft tables bench --results "$root"
