"""How one linear layer's latency grows with the number of rows M (tokens per forward) on this
CPU, per kernel: aten fp32 / bf16 / fp16, oneDNN fp32 (torch.utils.mkldnn), int8 dynamic.

Shape: Qwen2.5-Coder-1.5B's MLP up-projection (1536 -> 8960). Writes
results/spine/gemm_scaling.{json,md}.

    .venv/bin/python experiments/gemm_scaling.py
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch

from omnidraft import provenance

ROOT = Path(__file__).resolve().parent.parent
K, N = 1536, 8960
MS = [1, 2, 4, 6, 8]


def bench(f, x, reps: int = 20) -> float:
    with torch.no_grad():
        for _ in range(3):
            f(x)
        t = time.perf_counter()
        for _ in range(reps):
            f(x)
    return (time.perf_counter() - t) / reps


def kernels():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    lin = torch.nn.Linear(K, N, bias=False)
    lin.weight.data.copy_(w)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        wd = w.to(dt)
        yield f"aten {str(dt).removeprefix('torch.')}", (lambda x, wd=wd: torch.nn.functional.linear(x, wd)), dt
    from torch.utils import mkldnn

    m = mkldnn.to_mkldnn(torch.nn.Sequential(lin))
    yield "onednn float32", m, torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    yield "int8 dynamic (fbgemm)", q, torch.float32


def main() -> None:
    rows = []
    for name, f, dt in kernels():
        lat = {m: bench(f, torch.randn(m, K).to(dt)) for m in MS}
        rows.append({"kernel": name, "latency_ms": {m: v * 1e3 for m, v in lat.items()},
                     "relative_to_1": {m: v / lat[1] for m, v in lat.items()}})
        print(name, {m: round(v * 1e3, 2) for m, v in lat.items()}, flush=True)
    prov = provenance.collect(0, [])
    res = {"shape": [K, N], "rows": rows, "provenance": prov}
    out = ROOT / "results" / "spine" / "gemm_scaling"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    lines = [f"Linear {K}->{N}, latency (ms) by rows M, {prov['cpu']}, {prov['torch_threads']} threads.", "",
             "| kernel | " + " | ".join(f"M={m}" for m in MS) + " | " + " | ".join(f"{m}/1" for m in MS[1:]) + " |",
             "|---|" + "---|" * (2 * len(MS) - 1)]
    for r in rows:
        lines.append(f"| {r['kernel']} | " + " | ".join(f"{r['latency_ms'][m]:.2f}" for m in MS) + " | "
                     + " | ".join(f"{r['relative_to_1'][m]:.2f}" for m in MS[1:]) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
