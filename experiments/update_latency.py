"""Wall time of one online update (forward + backward + fused AdamW over a buffer), one forward pass
per example vs one tree-attention pass per sequence (OnlineLearner(tree=...)).

The buffer is synthetic but shaped like a GSM8K stream's: SEQS prompts, each EXAMPLES speculative
steps of K drafted tokens after a context that grows by ~3 tokens a step. Writes
results/profile/update_latency.{json,md}.

    .venv/bin/python experiments/update_latency.py                        # SmolLM2-135M -> Qwen-1.5B vocab
    .venv/bin/python experiments/update_latency.py --drafter qwen25_coder_05b --seqs 1
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from omnidraft import provenance
from omnidraft.config import CONF_DIR, register_configs
from omnidraft.data.models import _ensure_converted, load_model, parse_dtype
from omnidraft.drafting.direct_map import build_bridge
from omnidraft.learn.buffer import Example
from omnidraft.learn.online import OnlineLearner

ROOT = Path(__file__).resolve().parent.parent


def buffer(learner: OnlineLearner, vocab: list[int], seqs: int, examples: int, k: int, prompt: int,
           seed: int) -> list[Example]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(seqs):
        ctx = [rng.choice(vocab) for _ in range(prompt)]
        for _ in range(examples):
            drafts = [rng.choice(vocab) for _ in range(k)]
            logp = torch.log_softmax(torch.randn(k, len(learner.cols), generator=g) * 3, -1)
            out.append(Example(s, list(ctx), drafts, list(range(k)), logp.to(torch.float16)))
            ctx += drafts[: rng.randint(1, k)] + [rng.choice(vocab)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2_135m")
    ap.add_argument("--target", default="qwen25_coder_15b", help="only its tokenizer is loaded")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--examples", type=int, default=22, help="speculative steps per prompt")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=100, help="prompt length in drafter tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "profile" / "update_latency"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=unused", f"drafter={a.drafter}", f"target={a.target}"])
    dspec = OmegaConf.to_container(cfg.drafter, resolve=True)
    tspec = OmegaConf.to_container(cfg.target, resolve=True)
    cache = Path(cfg.paths.cache_dir)
    from transformers import AutoTokenizer

    ttok = AutoTokenizer.from_pretrained(_ensure_converted(tspec, cache, parse_dtype(tspec["dtype"])))
    drafter = load_model(dspec, cache)
    bridge = build_bridge(drafter.tokenizer, ttok, cache)
    vocab = bridge.draft_mask.nonzero().squeeze(1).tolist()
    rows = {}
    weights = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    for tree in (True, False):
        drafter.model.load_state_dict(weights)  # an update writes the drafter: both start equal
        learner = OnlineLearner(drafter.model, bridge, batch_size=8, tree=tree)
        learner.buffer = buffer(learner, vocab, 1, 3, a.k, a.prompt, seed=1)  # warm-up
        learner.update(progress=False)
        learner.buffer = buffer(learner, vocab, a.seqs, a.examples, a.k, a.prompt, seed=0)
        t0 = time.perf_counter()
        stats = learner.update(progress=False)
        rows["tree" if tree else "per_example"] = {
            "update_s": time.perf_counter() - t0, "n_examples": stats["adapt/n_examples"],
            "n_batches": stats["adapt/n_batches"], "loss": stats["adapt/loss"]}
        del learner
    res = {"drafter": a.drafter, "target_tokenizer": a.target, "seqs": a.seqs, "examples": a.examples,
           "k": a.k, "prompt": a.prompt, "threads": a.threads, "rows": rows,
           "speedup": rows["per_example"]["update_s"] / rows["tree"]["update_s"],
           "provenance": provenance.collect(0, [])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = [f"# One online update: {a.drafter} (fp32 training copy), {a.seqs} prompts x {a.examples} steps x k={a.k}",
          "", f"{res['provenance']['cpu']} ({res['provenance']['cpu_capability']}), {a.threads} thread(s).", "",
          "| forward passes | update s | examples | batches | loss |", "|---|---|---|---|---|"]
    md += [f"| {n} | {r['update_s']:.1f} | {r['n_examples']} | {r['n_batches']} | {r['loss']:.4f} |" for n, r in rows.items()]
    md += ["", f"Tree attention is {res['speedup']:.1f}x faster (same losses: tests/test_online.py)."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
