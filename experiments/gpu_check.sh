#!/usr/bin/env bash
# GPU readiness check on a machine with CUDA (issue 31): the `gpu`-marked tests on tiny models (greedy
# output == the target's on CUDA, cross- and same-vocab, training on; the CLI with device=auto), then
# a tiny calibration on the GPU. A few minutes. Needs a CUDA build of torch in .venv (README: Devices).
#   bash experiments/gpu_check.sh            # writes outputs/gpu_check/{pytest.txt,calibration.json}
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
"$PY" -m pytest -q -m gpu tests/test_gpu.py -rs 2>&1 | tee "$OUT/pytest.txt"
"$PY" -m omnidraft calibrate debug=tiny calibrate.repeats=3 target.device=cuda drafter.device=cuda \
  calibrate.out="$OUT/calibration.json" progress=false
echo "gpu check: done ($OUT)"
