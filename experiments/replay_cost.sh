#!/bin/bash
# Issue 28 cost check: the same omnidraft stream (default pair, GSM8K, 64 tokens, update every 8
# prompts) live (with its ar baseline, as the runner measures speed) and replayed from a trace, one
# thread each, one after the other on the same machine. Wall times of each command go to
# results/replay_cost/<name>/wall.json beside the run directories.
#   bash experiments/replay_cost.sh N [CORE]                  # fp32: the committed trace (it must hold N prompts)
#   DTYPE=bfloat16 bash experiments/replay_cost.sh N [CORE]   # both models bf16 (issue 28's dtype): a bf16
#       trace of the N prompts is made first under the output dir (batched, its wall time kept apart in
#       trace_wall.json) and the replay reads this machine's committed bf16 one-thread calibration
set -euo pipefail
N=${1:-20}
CORE=${2:-0}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
DTYPE=${DTYPE:-float32}
SUFFIX=""; [ "$DTYPE" = float32 ] || SUFFIX="_$DTYPE"
OUT=results/replay_cost/gsm8k_${N}${SUFFIX}
mkdir -p "$OUT"
COMMON=(task=gsm8k "task.limit=$N" decode.max_new_tokens=64 "target.dtype=$DTYPE" "drafter.dtype=$DTYPE" threads=1
        logger=none progress=false)
SLUG=$(.venv/bin/python -c "from omnidraft.calibrate import machine_slug; from omnidraft.provenance import cpu_flags, cpu_name; print(machine_slug('cpu', cpu_name(), cpu_flags()))")
CAL="results/calibration/qwen25_coder_15b-smollm2_135m/${SLUG}_${DTYPE}_1t.json"
if [ ! -f "$CAL" ]; then
  taskset -c "$CORE" .venv/bin/omnidraft calibrate "target.dtype=$DTYPE" "drafter.dtype=$DTYPE" threads=1 progress=false
fi
REPLAY=(engine=replay "replay.calibration=$CAL")
if [ "$DTYPE" != float32 ]; then  # a trace in this dtype (replay refuses a trace of another dtype)
  TRACE=$OUT/trace
  if [ ! -f "$OUT/trace_wall.json" ]; then
    t0=$(date +%s.%N)
    taskset -c "$CORE" .venv/bin/omnidraft trace task=gsm8k "task.limit=$N" decode.max_new_tokens=64 \
      "target.dtype=$DTYPE" threads=1 progress=false trace.batch_size=16 "trace.out_dir=$TRACE"
    t1=$(date +%s.%N)
    python3 -c "import json,sys; json.dump({'mode': 'trace', 'batch_size': 16, 'wall_s': float(sys.argv[2]) - float(sys.argv[1])}, open(sys.argv[3], 'w'))" \
      "$t0" "$t1" "$OUT/trace_wall.json"
  fi
  REPLAY+=("replay.trace=$TRACE")
fi
for mode in live replay; do
  [ -f "$OUT/$mode/summary.json" ] && grep -q '"status": "ok"' "$OUT/$mode/summary.json" && continue
  extra=(); [ "$mode" = replay ] && extra=("${REPLAY[@]}")
  t0=$(date +%s.%N)
  taskset -c "$CORE" .venv/bin/omnidraft "${COMMON[@]}" "${extra[@]}" "hydra.run.dir=$OUT/$mode"
  t1=$(date +%s.%N)
  python3 -c "import json,sys; json.dump({'mode': sys.argv[1], 'wall_s': float(sys.argv[3]) - float(sys.argv[2])}, open(sys.argv[4], 'w'))" \
    "$mode" "$t0" "$t1" "$OUT/$mode/wall.json"
done
python3 - "$OUT" "$DTYPE" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
w = {m: json.loads((out / m / "wall.json").read_text())["wall_s"] for m in ("live", "replay")}
s = {m: json.loads((out / m / "summary.json").read_text()) for m in ("live", "replay")}
res = {"live_wall_s": w["live"], "replay_wall_s": w["replay"], "ratio": w["live"] / w["replay"],
       "dtype": sys.argv[2],
       "accept_rate": {m: s[m]["accept/rate"] for m in s}, "cpu": s["live"]["provenance"].get("cpu"),
       "speedup_live": s["live"].get("speed/speedup"), "modelled_speedup_live": s["live"].get("speed/modelled_speedup"),
       "modelled_speedup_replay": s["replay"].get("speed/modelled_speedup")}
if (out / "trace_wall.json").exists():
    res["trace_wall_s"] = json.loads((out / "trace_wall.json").read_text())["wall_s"]
(out / "cost.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
PY
