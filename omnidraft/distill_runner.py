"""``run_distill(cfg) -> dict``: DistillSpec's offline distillation, the runner of ``omnidraft distill``.

Builds one training example per prompt of the configured task split (see omnidraft.distillspec),
trains the drafter with the chosen divergence for ``distill.epochs`` passes, and saves the
weights as an online state that ``method=distillspec drafter.init_state=<run_dir>/state`` loads.
Like :func:`omnidraft.runner.run` it reads the Hydra config; the decode core does not.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from omnidraft import state as state_io
from omnidraft.distill import DIVERGENCES
from omnidraft.distillspec import DATA, make_example
from omnidraft.errors import OmniDraftError
from omnidraft.loggers import JSONLLogger
from omnidraft.models import load_model
from omnidraft.online import OnlineLearner
from omnidraft.runner import _overrides, _plain, start_run, task_templates
from omnidraft.tasks import format_prompt, load_stream, render
from omnidraft.vocab import build_bridge


def check_distill(cfg: DictConfig) -> None:
    d = cfg.distill
    if d.data not in DATA:
        raise OmniDraftError(f"distill.data={d.data!r}: use drafter (on-policy) or target")
    if d.divergence not in DIVERGENCES:
        raise OmniDraftError(f"distill.divergence={d.divergence!r}: use one of {', '.join(DIVERGENCES)}")
    if d.epochs < 1:
        raise OmniDraftError(f"distill.epochs={d.epochs} must be >= 1")
    if cfg.drafter is None:
        raise OmniDraftError("omnidraft distill needs a drafter model; pass drafter=<name>")
    from omnidraft.online import DTYPES

    if d.train_dtype not in DTYPES:
        raise OmniDraftError(f"distill.train_dtype={d.train_dtype!r}: use one of {', '.join(DTYPES)}")
    if not 0 <= d.jsd_beta <= 1:
        raise OmniDraftError(f"distill.jsd_beta={d.jsd_beta} must be in [0, 1]")


@torch.no_grad()
def _mean_loss(learner: OnlineLearner, examples, chunk: int = 4) -> float:
    """Mean divergence over all training positions, in chunks of examples (bounded memory)."""
    tot = n = 0.0
    for s in range(0, len(examples), chunk):
        part = examples[s: s + chunk]
        w = sum(len(e.dm_pos) for e in part)
        tot += float(learner.losses(part)["loss"]) * w
        n += w
    return tot / max(1.0, n)


def run_distill(cfg: DictConfig) -> dict[str, Any]:
    check_distill(cfg)
    d = cfg.distill
    run_dir, prov = start_run(cfg, _overrides(cfg))
    cache = Path(cfg.paths.cache_dir)
    target = load_model(_plain(cfg.target), cache)
    draft = load_model(_plain(cfg.drafter), cache)
    bridge = build_bridge(draft.tokenizer, target.tokenizer, cache)
    learner = OnlineLearner(draft.model, bridge, loss=d.divergence, lr=d.lr, weight_decay=d.weight_decay,
                            batch_size=1, steps_per_update=int(d.epochs), seed=int(cfg.seed),
                            train_dtype=d.train_dtype, jsd_beta=d.jsd_beta)
    records = load_stream(_plain(cfg.task), cache, seed=int(cfg.seed))
    t = cfg.task
    if not records:
        raise OmniDraftError(f"task {t.name} has no prompts at task.offset={t.offset}; lower task.offset "
                             "(it must stay disjoint from the evaluation prompts)")
    templates = task_templates(t)
    log = JSONLLogger(run_dir / "metrics.jsonl")
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    status = "ok"
    t0 = time.perf_counter()
    try:
        g = torch.Generator().manual_seed(int(cfg.seed))
        for i, r in enumerate(tqdm(records, desc=f"distill data ({d.data})", unit="prompt",
                                   disable=not cfg.progress)):
            ids = format_prompt(target.tokenizer, render(r, 0, templates), system=t.system_prompt,
                                use_chat_template=cfg.target.chat_template)
            ex, st = make_example(i, target.model, target.tokenizer, draft.model, draft.tokenizer, bridge,
                                  learner.cols, ids, data=d.data, max_new_tokens=int(d.max_new_tokens),
                                  eos_ids=target.eos_ids, draft_eos=draft.eos_ids,
                                  temperature=float(d.temperature), generator=g)
            if ex is not None:
                learner.buffer.append(ex)
            row = {"prompt/id": r.id, "prompt/index": i, **st}
            rows.append(row)
            log.log(row, step=i)
        if not learner.buffer:
            raise OmniDraftError("no training position aligned between the two tokenisations; check the pair")
        data_s = time.perf_counter() - t0
        examples = list(learner.buffer)
        before = _mean_loss(learner, examples)
        t1 = time.perf_counter()
        upd = learner.update(progress=bool(cfg.progress))  # epochs = steps_per_update passes, one prompt per step
        train_s = time.perf_counter() - t1
        after = _mean_loss(learner, examples)
        tensors, lmeta = learner.state_dict()
        tensors = {k: v for k, v in tensors.items() if k.startswith("param.")}  # weights only: a frozen drafter
        meta = {"kind": "distillspec", "lora": None, "next_index": len(records),
                "learner": {"names": lmeta["names"]}, "distill": _plain(d),
                # checked by runner.check_disjoint before any evaluation that loads this state
                "train_split": {"task": t.name, "offset": int(t.offset), "n": len(records),
                                "shuffle": bool(t.shuffle), "seed": int(cfg.seed)}}
        state_io.save(run_dir / "state", state_io.SavedState(meta, tensors, []))
        summary = {"distill/loss_before": before, "distill/loss_after": after,
                   "distill/n_examples": len(examples),
                   "distill/positions": sum(len(e.dm_pos) for e in examples),
                   "distill/response_tokens": sum(r["distill/response_tokens"] for r in rows),
                   "distill/data_s": data_s, "distill/train_s": train_s, "distill/optimizer_steps": upd.get("adapt/n_batches"),
                   "state_dir": os.path.relpath(run_dir / "state")}
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        summary.update({"status": status, "n_prompts": len(rows), "target": cfg.target.name,
                        "drafter": cfg.drafter.name, "task": t.name, "task_offset": int(t.offset),
                        "data": d.data, "divergence": d.divergence, "provenance": prov})
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        os.replace(tmp, run_dir / "summary.json")
        log.close()
    return summary
