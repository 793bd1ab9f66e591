#!/bin/bash
# Issue 28, machine independence in bfloat16: the real-model replay check (SmolLM2-135M ->
# Qwen2.5-Coder-0.5B, 10 GSM8K prompts, 48 tokens, omnidraft with an update every 2 prompts; the
# fp32 one is results/replay_check/) with both models in bf16: a bf16 trace, the live run (which also
# times ar on every prompt), and replays (batched rows) at 1 and 2 torch threads, compared step by step
# with the live run and with each other by
#   omnidraft tables replay_check --results results/bf16    # -> results/bf16/replay_check/table.md
# Resumable: a finished run is skipped. Needs a CPU with native bf16 (AVX512-BF16 / AMX) to be quick.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/bf16
M=(target=qwen25_coder_05b drafter=smollm2_135m target.dtype=bfloat16 drafter.dtype=bfloat16 task=gsm8k
   task.limit=10 decode.max_new_tokens=48 progress=false)
TRACE=$OUT/traces/qwen25_coder_05b/gsm8k
OMP_NUM_THREADS=1 .venv/bin/omnidraft trace "${M[@]}" threads=1 "trace.out_dir=$TRACE"
# this machine's one-thread calibration (made here when missing); the 2-thread replay reads it too: its
# steps are the point, not its modelled speed
SLUG=$(.venv/bin/python -c "from omnidraft.calibrate import machine_slug; from omnidraft.provenance import cpu_flags, cpu_name; print(machine_slug('cpu', cpu_name(), cpu_flags()))")
CAL=results/calibration/qwen25_coder_05b-smollm2_135m/${SLUG}_bfloat16_1t.json
if [ ! -f "$CAL" ]; then
  OMP_NUM_THREADS=1 .venv/bin/omnidraft calibrate target=qwen25_coder_05b drafter=smollm2_135m \
    target.dtype=bfloat16 drafter.dtype=bfloat16 threads=1 progress=false
fi
R=(method=omnidraft method.adapt.interval=2 logger=none)
run() {  # name threads extra...
  local name=$1 t=$2; shift 2
  [ -f "$OUT/replay_check/$name/summary.json" ] && grep -q '"status": "ok"' "$OUT/replay_check/$name/summary.json" && return
  OMP_NUM_THREADS=$t .venv/bin/omnidraft "${M[@]}" "${R[@]}" "threads=$t" "$@" "hydra.run.dir=$OUT/replay_check/$name"
}
run live 1
run replay_1thread 1 engine=replay "replay.trace=$TRACE" "replay.calibration=$CAL"
run replay_2threads 2 engine=replay "replay.trace=$TRACE" "replay.calibration=$CAL"
.venv/bin/omnidraft tables replay_check --results "$OUT"
