#!/bin/bash
# Copy the small files of run directories kept outside the checkout into results/ (same relative
# paths, removing ones the run dir lacks, e.g. summary.json of a run still streaming); state/ and
# data/ (large, regenerable) stay where they are.
#   bash experiments/copy_results.sh ROOT REL_DIR...    e.g. /work/runs adaptive/sv_fixed bench/runs/gsm8k
set -euo pipefail
cd "$(dirname "$0")/.."
root=$1; shift
[ "$root" = results ] && exit 0
for d in "$@"; do
  mkdir -p "results/$d"
  for f in config.yaml metrics.jsonl summary.json provenance.json; do
    # a file the run has not written (yet) goes, so results/ never mixes two runs' files
    if [ -f "$root/$d/$f" ]; then cp "$root/$d/$f" "results/$d/"; else rm -f "results/$d/$f"; fi
  done
done
