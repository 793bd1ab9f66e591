"""Certify after the fact the outputs of a greedy bench run that differ from ar (benches since
session 22 certify them while they run): for each prompt with a divergence, ar is decoded again in
the bench's own settings (dtype, threads, prompts), and at each method's first differing position
the target's top-2 logit gap is recomputed batched and stepwise (omnidraft.core.certify). Writes
<run>/certification.json; the rows are left as they are.

    .venv/bin/python experiments/certify_bench.py results/bench_vs_baselines/<machine>/bench/runs/gsm8k
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from omnidraft.bench import _base_overrides, bench_prompts
from omnidraft.config import register_configs
from omnidraft.core.certify import certify
from omnidraft.data.models import load_model
from omnidraft.lifecycle import resolve_dtypes, to_plain


def main(run: Path) -> None:
    register_configs()
    cfg = OmegaConf.load(run / "config.yaml")
    torch.set_num_threads(int(cfg.threads or 1))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in rows if not r["lossless/match"]]
    cfg.overrides = json.loads((run / "provenance.json").read_text())["overrides"]  # what the bench was run with
    base = _base_overrides(cfg)
    resolve_dtypes(cfg)
    target = load_model(to_plain(cfg.target), Path(cfg.paths.cache_dir).expanduser())
    done_file = run / "certification.json"  # run again as the bench goes on: certified rows are kept
    out = json.loads(done_file.read_text())["rows"] if done_file.exists() else []
    seen = {(o["method"], o["prompt/index"]) for o in out}
    bad = [r for r in bad if (r["method"], r["prompt/index"]) not in seen]
    prompts = {(task, rid): (ids, ref) for task, rid, ids, ref in bench_prompts(cfg, base, target)} if bad else {}
    ar_of = {}
    for r in bad:
        ids, ref = prompts[(r["task"], r["prompt/id"])]
        if r["prompt/id"] not in ar_of:
            ar_of[r["prompt/id"]] = ref.generate(ids, seed=0, max_new_tokens=int(cfg.decode.max_new_tokens)).tokens
        ar = ar_of[r["prompt/id"]]
        p = int(r["lossless/first_mismatch"])
        cert = certify(target.model, ids, ar[:p] + [-1], ar) or {}
        out.append({"method": r["method"], "prompt/index": r["prompt/index"], "prompt/id": r["prompt/id"],
                    "ar_len_matches": len(ar) == r["ar/new_tokens"], **cert})
        print(json.dumps(out[-1]), flush=True)
    summary = {"n_rows": len(rows), "n_differing": len(out),
               "near_ties": sum(bool(o.get("lossless/near_tie")) for o in out),
               "ar_reproduced": all(o["ar_len_matches"] for o in out), "rows": out}
    done_file.write_text(json.dumps(summary, indent=1))
    print({k: v for k, v in summary.items() if k != "rows"})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
