"""Forward latency of a model vs the number of tokens fed per call, after a cached prefix.

Speculative decoding pays only when verifying k+1 tokens costs about one single-token step. This
measures that on the machine at hand, per dtype, and writes results/spine/step_latency.{json,md}.

    .venv/bin/python experiments/step_latency.py                       # default pair, bf16 + fp32
    .venv/bin/python experiments/step_latency.py --models qwen25_coder_05b --dtypes float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from omnidraft import provenance
from omnidraft.config import CONF_DIR, register_configs
from omnidraft.core import kv
from omnidraft.data.models import load_model

ROOT = Path(__file__).resolve().parent.parent


def model_spec(name: str, dtype: str) -> dict:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=unused", f"target={name}", f"target.dtype={dtype}"])
    return OmegaConf.to_container(cfg.target, resolve=True), cfg.paths.cache_dir


def measure(lm, n_tokens: list[int], prefix: int, reps: int) -> dict[int, float]:
    ids = list(range(1000, 1000 + prefix + max(n_tokens)))
    out = {}
    for n in n_tokens:
        ts = []
        for r in range(reps + 1):
            cache = kv.new_cache(lm.model)
            kv.forward(lm.model, ids[:prefix], cache, keep=1)
            t = time.perf_counter()
            kv.forward(lm.model, ids[prefix: prefix + n], cache)
            if r:  # first repetition is warm-up
                ts.append(time.perf_counter() - t)
        out[n] = statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen25_coder_15b", "smollm2_135m"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 6, 8])
    ap.add_argument("--prefix", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "spine" / "step_latency"))
    a = ap.parse_args()
    rows = []
    for name in a.models:
        # Load the cached bf16 conversion once and cast: latency depends on the dtype, not on how
        # the weights were rounded.
        spec, cache = model_spec(name, "bfloat16")
        lm = load_model(spec, Path(cache))
        for dt in a.dtypes:
            lm.model.to(getattr(torch, dt))
            lat = measure(lm, a.tokens, a.prefix, a.reps)
            rows.append({"model": name, "dtype": dt, "latency_ms": {n: v * 1e3 for n, v in lat.items()},
                         "relative_to_1": {n: v / lat[a.tokens[0]] for n, v in lat.items()}})
            print(name, dt, {n: round(v * 1e3, 1) for n, v in lat.items()}, flush=True)
        del lm
    res = {"prefix": a.prefix, "reps": a.reps, "rows": rows, "provenance": provenance.collect(0, [])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    hdr = "| model | dtype | " + " | ".join(f"{n} tok (ms)" for n in a.tokens) + " | " + \
        " | ".join(f"{n}/1" for n in a.tokens[1:]) + " |"
    lines = [f"Forward latency after a {a.prefix}-token cache, median of {a.reps} "
             f"(CPU: {res['provenance']['cpu']}, {res['provenance']['torch_threads']} threads).", "",
             hdr, "|" + "---|" * (2 + 2 * len(a.tokens) - 1)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | " + " | ".join(f"{r['latency_ms'][n]:.0f}" for n in a.tokens)
                     + " | " + " | ".join(f"{r['relative_to_1'][n]:.2f}" for n in a.tokens[1:]) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
