#!/bin/bash
# Issue 4: 5 prompts of each offline task on the default pair and default method (omnidraft),
# ar on every prompt (equality + speedup), code executed in the sandbox for pass@1.
#   bash experiments/run_task_probes.sh [task ...]      (default: all five)
# Writes results/tasks/<task>/ (summary.json, config.yaml, metrics.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
tasks=${*:-gsm8k alpaca mt_bench humaneval mbpp}
for t in $tasks; do
  extra=()
  case $t in
    humaneval|mbpp) extra=(task.execute_code=true decode.max_new_tokens=192) ;;
  esac
  .venv/bin/omnidraft task=$t task.limit=5 logger=none "${extra[@]}" hydra.run.dir=results/tasks/$t
done
