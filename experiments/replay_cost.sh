#!/bin/bash
# Issue 28 cost check: the same omnidraft stream (default pair, fp32, GSM8K, 64 tokens, update every
# 8 prompts) live (with its ar baseline, as the runner measures speed) and replayed from the committed
# trace, one thread each, one after the other on the same machine. Wall times of each command go to
# results/replay_cost/<name>/wall.json beside the run directories.
#   bash experiments/replay_cost.sh N [CORE]        # N prompts (the trace must hold them)
set -euo pipefail
N=${1:-20}
CORE=${2:-0}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
OUT=results/replay_cost/gsm8k_${N}
mkdir -p "$OUT"
COMMON=(task=gsm8k "task.limit=$N" decode.max_new_tokens=64 target.dtype=float32 drafter.dtype=float32 threads=1
        logger=none progress=false)
CAL="results/calibration/qwen25_coder_15b-smollm2_135m"
if ! ls "$CAL"/*_float32_1t.json >/dev/null 2>&1; then
  taskset -c "$CORE" .venv/bin/omnidraft calibrate target.dtype=float32 drafter.dtype=float32 threads=1 progress=false
fi
for mode in live replay; do
  [ -f "$OUT/$mode/summary.json" ] && grep -q '"status": "ok"' "$OUT/$mode/summary.json" && continue
  extra=(); [ "$mode" = replay ] && extra=(engine=replay)
  t0=$(date +%s.%N)
  taskset -c "$CORE" .venv/bin/omnidraft "${COMMON[@]}" "${extra[@]}" "hydra.run.dir=$OUT/$mode"
  t1=$(date +%s.%N)
  python3 -c "import json,sys; json.dump({'mode': sys.argv[1], 'wall_s': float(sys.argv[3]) - float(sys.argv[2])}, open(sys.argv[4], 'w'))" \
    "$mode" "$t0" "$t1" "$OUT/$mode/wall.json"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
w = {m: json.loads((out / m / "wall.json").read_text())["wall_s"] for m in ("live", "replay")}
s = {m: json.loads((out / m / "summary.json").read_text()) for m in ("live", "replay")}
res = {"live_wall_s": w["live"], "replay_wall_s": w["replay"], "ratio": w["live"] / w["replay"],
       "accept_rate": {m: s[m]["accept/rate"] for m in s}, "cpu": s["live"]["provenance"].get("cpu"),
       "speedup_live": s["live"].get("speed/speedup"), "modelled_speedup_live": s["live"].get("speed/modelled_speedup"),
       "modelled_speedup_replay": s["replay"].get("speed/modelled_speedup")}
(out / "cost.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
PY
