"""``run_distill(cfg) -> dict``: DistillSpec's offline distillation, the runner of ``omnidraft distill``.

Builds one training example per prompt of the configured task split (see omnidraft.learn.distillspec),
saved as it goes under ``run_dir/data/`` (``resume=true`` continues an interrupted data build),
trains the drafter with the chosen divergence for ``distill.epochs`` passes, and saves the
weights as an online state that ``method=distillspec drafter.init_state=<run_dir>/state`` loads.
Like :func:`omnidraft.runner.run` it reads the Hydra config; the decode core does not.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from omnidraft import state as state_io
from omnidraft.config import check_schema, check_stream_only, task_templates
from omnidraft.data.models import load_model
from omnidraft.data.tasks import format_prompt, load_stream, render
from omnidraft.drafting.direct_map import build_bridge
from omnidraft.errors import OmniDraftError
from omnidraft.learn.buffer import Example
from omnidraft.learn.distillspec import make_example
from omnidraft.learn.online import OnlineLearner
from omnidraft.lifecycle import RunContext, command_overrides, resolve_dtypes, to_plain


def check_distill(cfg: DictConfig) -> None:
    """Everything that can be checked before a model loads (distill.* values: the schema's)."""
    check_schema(cfg)
    check_stream_only(cfg, "omnidraft distill")
    if cfg.drafter is None:
        raise OmniDraftError("omnidraft distill needs a drafter model; pass drafter=<name>")


def _data_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What the training data depends on (a resumed run must match it)."""
    d = cfg.distill
    return {"target": to_plain(cfg.target), "drafter": to_plain(cfg.drafter), "task": to_plain(cfg.task),
            "seed": int(cfg.seed), "data": d.data, "max_new_tokens": int(d.max_new_tokens),
            "temperature": float(d.temperature)}


def _load_data(data_dir: Path, fp: dict[str, Any], resume: bool) -> dict[int, tuple[Example | None, dict]]:
    """Examples already built in ``data_dir`` (one safetensors file per prompt), when resuming."""
    meta = data_dir / "meta.json"
    if not resume:
        if data_dir.exists():
            shutil.rmtree(data_dir)  # a fresh run in an old directory starts fresh
        data_dir.mkdir(parents=True)
        meta.write_text(json.dumps(fp, default=str))
        return {}
    if not meta.exists():
        raise OmniDraftError(f"resume=true but {data_dir} holds no distillation data; drop resume=true")
    saved = state_io.read_meta(meta)
    if saved != json.loads(json.dumps(fp, default=str)):
        diff = next(k for k in fp if json.dumps(saved.get(k), default=str) != json.dumps(fp[k], default=str))
        raise OmniDraftError(f"cannot resume the distillation data in {data_dir}: {diff} differs from the "
                             "interrupted run; resume with its overrides or use a new run_dir")
    out = {}
    for f in sorted(data_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            m = h.metadata()
            row, exm = json.loads(m["row"]), json.loads(m["example"])
            ex = None if exm is None else Example(**exm, dm_logp=h.get_tensor("dm_logp"))
        out[int(f.stem)] = (ex, row)
    return out


def _save_example(data_dir: Path, i: int, ex: Example | None, row: dict) -> None:
    """One prompt's example, written atomically (safetensors + JSON metadata, no pickle)."""
    exm = None if ex is None else {k: v for k, v in asdict(ex).items() if k != "dm_logp"}
    t = {"dm_logp": (ex.dm_logp if ex is not None else torch.zeros(0)).contiguous()}
    tmp = data_dir / f"{i:05d}.tmp"
    save_file(t, str(tmp), metadata={"row": json.dumps(row), "example": json.dumps(exm)})
    os.replace(tmp, data_dir / f"{i:05d}.safetensors")


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
    resolve_dtypes(cfg)
    d = cfg.distill
    ctx = RunContext(cfg, command_overrides(cfg))
    run_dir = ctx.run_dir
    cache = Path(cfg.paths.cache_dir)
    target = load_model(to_plain(cfg.target), cache)
    draft = load_model(to_plain(cfg.drafter), cache)
    bridge = build_bridge(draft.tokenizer, target.tokenizer, cache)
    learner = OnlineLearner(draft.model, bridge, loss=d.divergence, lr=d.lr, weight_decay=d.weight_decay,
                            batch_size=1, steps_per_update=int(d.epochs), seed=int(cfg.seed),
                            train_dtype=d.train_dtype, jsd_beta=d.jsd_beta)
    records = load_stream(to_plain(cfg.task), cache, seed=int(cfg.seed))
    t = cfg.task
    if not records:
        raise OmniDraftError(f"task {t.name} has no prompts at task.offset={t.offset}; lower task.offset "
                             "(it must stay disjoint from the evaluation prompts)")
    templates = task_templates(t)
    data_dir = run_dir / "data"
    done = _load_data(data_dir, _data_fingerprint(cfg), bool(cfg.resume))
    if not cfg.resume:  # resume=true continues the data build and its log
        ctx.drop_metrics()
    log = ctx.open_log()  # metrics.jsonl, and the logger config's sinks (wandb offline by default)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}  # the distillation's results, once it finished

    def summary_of(status: str) -> dict[str, Any]:
        return {**summary, "status": status, "n_prompts": len(rows), "target": cfg.target.name,
                "drafter": cfg.drafter.name, "task": t.name, "task_offset": int(t.offset),
                "data": d.data, "divergence": d.divergence, "provenance": ctx.prov}

    t0 = time.perf_counter()
    with ctx.finishing(summary_of):
        for i, r in enumerate(tqdm(records, desc=f"distill data ({d.data})", unit="prompt",
                                   disable=not cfg.progress, initial=0)):
            if i in done:  # built by an earlier, interrupted run (resume=true)
                ex, row = done[i]
            else:
                ids = format_prompt(target.tokenizer, render(r, 0, templates), system=t.system_prompt,
                                    use_chat_template=cfg.target.chat_template)
                g = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + i)
                ex, st = make_example(i, target.model, target.tokenizer, draft.model, draft.tokenizer, bridge,
                                      learner.cols, ids, data=d.data, max_new_tokens=int(d.max_new_tokens),
                                      eos_ids=target.eos_ids, draft_eos=draft.eos_ids,
                                      temperature=float(d.temperature), generator=g)
                row = {"prompt/id": r.id, "prompt/index": i, **st}
                _save_example(data_dir, i, ex, row)
                log.log(row, step=i)
            if ex is not None:
                learner.buffer.append(ex)
            rows.append(row)
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
                "learner": {"names": lmeta["names"]}, "distill": to_plain(d),
                # checked by runner.check_disjoint before any evaluation that loads this state
                "train_split": {"task": t.name, "offset": int(t.offset), "n": len(records),
                                "shuffle": bool(t.shuffle), "seed": int(cfg.seed)}}
        state_io.save(run_dir / "state", state_io.SavedState(meta, tensors, []))
        summary.update({"distill/loss_before": before, "distill/loss_after": after,
                        "distill/n_examples": len(examples),
                        "distill/positions": sum(len(e.dm_pos) for e in examples),
                        "distill/response_tokens": sum(r["distill/response_tokens"] for r in rows),
                        "distill/data_s": data_s, "distill/train_s": train_s,
                        "distill/optimizer_steps": upd.get("adapt/n_batches"),
                        "state_dir": os.path.relpath(run_dir / "state")})
    return ctx.summary
