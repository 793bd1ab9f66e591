"""``omnidraft bench``: every selected method on the same prompts, in ONE process.

The target loads once and is shared; each method gets its own :class:`omnidraft.runner.Session`;
methods whose drafter trains or starts from a saved state get their own drafter copy, the frozen
base drafter is loaded once for all the others. After a warm-up, each
prompt is decoded by every method in an order rotated per prompt, so machine drift hits all
methods equally. Token counting is the harness's: new target tokens (EOS included) over the wall
time of the whole generation (prefill included). Online methods (osd, omnidraft) keep adapting
between prompts; their update time is reported apart and is not in their generation time.

Per method: tokens/s, speedup against ``ar`` (ratio of totals, and the mean of per-prompt
ratios), acceptance rate, mean accepted length, equality with ``ar`` token by token (under greedy,
each divergence certified a numerical near-tie or not: :mod:`omnidraft.core.certify`), peak RSS
sampled after each of its generations (process-wide: mostly common to all methods), the memory
only it holds (``mem/own_gib``: own drafter copy, training copy, optimiser state), and framework
overhead: the share of its generation wall time spent outside model forward passes (measured with
forward hooks, omnidraft.profiling). On CUDA those hooks synchronise after every forward, which
costs a method in proportion to its forward count: take GPU speedups from ``bench.profile=false``.
Writes ``<out_dir>/<date>_<target>-<drafter>_<tasks>.json`` and ``.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from tqdm.auto import tqdm

from omnidraft.config import CONF_DIR, check_stream_only
from omnidraft.core.certify import certify, first_divergence
from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import RunContext, check_resume, command_overrides, fingerprint, resolve_dtypes, write_json
from omnidraft.profiling import ForwardTimer, peak_rss_gib, rss_gib
from omnidraft.tables import bench_markdown, bench_row, bench_summary


def check_bench(cfg: DictConfig) -> None:
    check_stream_only(cfg, "omnidraft bench")
    b = cfg.bench
    if not b.methods:
        raise OmniDraftError("bench.methods is empty; list methods, e.g. bench.methods=[ar,spd_dm,omnidraft]")
    if "ar" not in b.methods:
        raise OmniDraftError("bench.methods must include ar: every speedup is a ratio against it")
    conf = Path(CONF_DIR) / "method"
    known = ", ".join(sorted(p.stem for p in conf.glob("*.yaml")))
    variants = b.get("variants") or {}
    for label, v in variants.items():
        if not isinstance(v, DictConfig) or "method" not in v or set(v) - {"method", "overrides"} \
                or not isinstance(v.get("overrides"), (ListConfig, type(None))):
            raise OmniDraftError(f"bench.variants.{label}: give a method and a list of "
                                 "overrides, e.g. '+bench.variants.omnidraft_h={method:omnidraft,"
                                 "overrides:[\"method.draft_length.policy=heuristic\"]}'")
        if (conf / f"{label}.yaml").exists():
            raise OmniDraftError(f"bench.variants.{label}: {label!r} is a method's name; give the variant another "
                                 "label (e.g. omnidraft_heuristic)")
        if not (conf / f"{v.method}.yaml").exists():
            raise OmniDraftError(f"bench.variants.{label}.method={v.method!r} is not a method; known: {known}")
        bad = [o for o in (v.overrides or []) if o.lstrip("+~").startswith("method=")]
        if bad:
            raise OmniDraftError(f"bench.variants.{label} sets {bad[0]!r}: the variant's method is "
                                 f"bench.variants.{label}.method")
    if len(set(b.methods)) != len(b.methods):
        raise OmniDraftError(f"bench.methods lists a method twice: {list(b.methods)}")
    for m in b.methods:
        if m not in variants and not (conf / f"{m}.yaml").exists():
            raise OmniDraftError(f"bench.methods has unknown method {m!r}; known: {known}"
                                 + (f"; variants: {', '.join(variants)}" if variants else ""))
    if not b.tasks:
        raise OmniDraftError("bench.tasks is empty; e.g. bench.tasks=[gsm8k,humaneval]")
    if b.limit < 1:
        raise OmniDraftError(f"bench.limit={b.limit} must be >= 1 (prompts per task)")
    per_method = [(f"method_overrides.{m}", over) for m, over in (b.method_overrides or {}).items()]
    per_method += [(f"variants.{m}.overrides", v.overrides) for m, v in variants.items()]
    for where, over in per_method:
        bad = [o for o in (over or []) if o.lstrip("+~").startswith(("target", "task", "decode", "seed"))]
        if bad:
            raise OmniDraftError(f"bench.{where} sets {bad[0]!r}: target, task, decoding and seed are "
                                 "shared by every method of a bench; set them for the whole bench")
    for task, over in (b.task_overrides or {}).items():
        if not (conf.parent / "task" / f"{task}.yaml").exists():
            raise OmniDraftError(f"bench.task_overrides.{task}: no task {task!r} (conf/task/{task}.yaml)")
        bad = [o for o in (over or []) if not o.lstrip("+~").startswith("task.")]
        if bad:
            raise OmniDraftError(f"bench.task_overrides.{task} sets {bad[0]!r}: only task.* keys (e.g. task.offset=300)")
    base = _base_overrides(cfg)
    for m in b.methods:  # every method's own config, checked before any model loads
        for task in b.tasks:
            try:
                method_config(m, task, cfg, base)
            except OmniDraftError as e:
                raise OmniDraftError(f"bench method {m!r} on {task}: {e}") from None


def _base_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides (``cfg.overrides`` outside Hydra), minus the bench's own keys,
    hydra's and ``resume``/``state_dir`` (the bench resumes every method from its own checkpoint;
    a method composed with resume=true would refuse its drafter.init_state): each method's config
    is composed from them."""
    return [o for o in command_overrides(cfg)
            if not o.lstrip("+~").startswith(("bench.", "bench_suite=", "hydra.", "hydra/", "run_dir=", "resume=",
                                              "state_dir="))]


def method_config(name: str, task: str, cfg: DictConfig, base: list[str]) -> DictConfig:
    """The full run config of one method (or variant) on one task, composed like
    ``omnidraft method=<name>`` (a variant: ``method=<its method> <its overrides>``)."""
    from hydra import compose

    variant = (cfg.bench.get("variants") or {}).get(name)
    method = variant.method if variant is not None else name
    extra = [*((variant.get("overrides") or []) if variant is not None else []),
             *((cfg.bench.method_overrides or {}).get(name, []) or [])]
    task_extra = list((cfg.bench.task_overrides or {}).get(task, []) or [])
    over = [*base, f"method={method}", f"task={task}", f"task.limit={int(cfg.bench.limit)}", *task_extra,
            "run_dir=unused", *extra]  # a method's own run_dir is not used: the bench writes its files
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside `omnidraft bench`
        c = compose("config", overrides=over)
    else:  # called from Python (tests, notebooks)
        from hydra import initialize_config_dir

        with initialize_config_dir(config_dir=CONF_DIR,
                                   version_base="1.3"):
            c = compose("config", overrides=over)
    from omnidraft.runner import check_config

    check_config(c)
    return c


def own_memory_gib(sess, shared) -> float:
    """Memory held by one method alone (GiB): its own drafter copy (not a shared one), its fp32
    training copy and optimiser state. The target and shared drafters are common to all methods."""
    seen: set[int] = set()

    def size(tensors) -> int:
        n = 0
        for t in tensors:
            if torch.is_tensor(t) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n

    shared_ids = {id(s) for s in shared}
    total = 0
    if sess.draft_lm is not None and id(sess.draft_lm) not in shared_ids:
        total += size(sess.draft_lm.model.parameters())
    if sess.learner is not None:
        total += size(sess.learner.train_model.parameters())
        total += size(v for st in sess.learner.opt.state.values() for v in st.values())
    return total / 2**30


def bench_prompts(cfg: DictConfig, base: list[str], target) -> list[tuple[str, str, list[int], Any]]:
    """The bench's prompts in order, as ``(task, record id, target ids, session)``: each task's stream
    (``bench.limit``, ``bench.task_overrides``) rendered by an ``ar`` session on ``target``, which is
    returned too (it decodes ``ar`` again for :file:`experiments/certify_bench.py`)."""
    from omnidraft.config import task_templates
    from omnidraft.data.tasks import load_stream, render
    from omnidraft.lifecycle import to_plain
    from omnidraft.runner import Session

    out = []
    for task in cfg.bench.tasks:
        c = method_config("ar", task, cfg, base)
        ref = Session(c, target=target)
        templates = task_templates(c.task)
        for r in load_stream(to_plain(c.task), Path(cfg.paths.cache_dir), seed=int(cfg.seed)):
            out.append((task, r.id, ref.prompt_ids(render(r, 0, templates)), ref))
    return out


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    from omnidraft import state as state_io
    from omnidraft.lifecycle import to_plain
    from omnidraft.runner import Session, uses_draft_model

    check_bench(cfg)
    resolve_dtypes(cfg)  # each method's config resolves `auto` the same way when its models load
    b = cfg.bench
    base = _base_overrides(cfg)
    state_root = Path(cfg.state_dir) if cfg.state_dir else Path(cfg.run_dir) / "state"
    saved = None
    if cfg.resume:  # a bench of many hours continues from its last checkpoint
        if not (state_root / "bench.json").is_file():
            raise OmniDraftError(f"resume=true: no bench checkpoint in {state_root}; pass the interrupted bench's "
                                 "directory (hydra.run.dir=results/bench/runs/<its time>) or drop resume")
        saved = json.loads((state_root / "bench.json").read_text())
        check_resume(cfg, saved["fingerprint"], f"the bench in {state_root}", "resume with its original overrides")
    ctx = RunContext(cfg, list(base) + [f"bench.{k}={v}" for k, v in to_plain(b).items()])
    run_dir = ctx.run_dir
    methods = list(b.methods)

    from omnidraft.data.models import load_model

    target = load_model(to_plain(cfg.target), Path(cfg.paths.cache_dir))
    sessions, shared = {}, {}
    for m in tqdm(methods, desc="load methods", disable=not cfg.progress):
        c = method_config(m, b.tasks[0], cfg, base)
        draft = None
        if uses_draft_model(c.method) and not c.method.adapt.enabled and not c.drafter.init_state:
            key = json.dumps(to_plain(c.drafter), sort_keys=True)  # one copy serves spd_dm, uag, uag_k5, ...
            if key not in shared:
                shared[key] = load_model(to_plain(c.drafter), Path(cfg.paths.cache_dir))
            draft = shared[key]
        sessions[m] = Session(c, target=target, draft=draft)
    prompts = [(task, rid, ids) for task, rid, ids, _ in bench_prompts(cfg, base, target)]
    for _, rid, ids in prompts:
        for sess in sessions.values():  # the drafters' contexts too
            sess.check_context(rid, len(ids))
    n_new = int(cfg.decode.max_new_tokens)
    greedy = float(cfg.method.temperature) <= 0

    for m in methods:  # warm-up: allocator, kernels, tokenizer caches; nothing learned, nothing logged
        with sessions[m].paused():
            for _, _, ids in prompts[: int(b.warmup_prompts)]:
                sessions[m].generate(ids, max_new_tokens=16)

    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    if saved is not None:
        start = int(saved["next_index"])
        if [p[1] for p in prompts[:start]] != saved["prompt_ids"]:
            raise OmniDraftError(f"cannot resume the bench in {state_root}: its prompts differ from this config's")
        for m in methods:
            st = state_io.load(state_root / saved["dir"] / m)
            sessions[m].restore(st)
            rows[m] = list(st.rows)
        ctx.resume(start, saved["segments"], ((i, rows[m][i]) for i in range(start) for m in methods))
    else:
        ctx.fresh()
    start = ctx.start

    def checkpoint(next_index: int) -> None:
        """Every method's state after ``next_index`` prompts in a new folder; bench.json, written
        last and atomically, names it, so a checkpoint is whole or absent; older folders go."""
        folder = f"at_{next_index:05d}"
        for m in methods:  # online methods: weights, optimiser, cache; uag: the heuristic's length
            state_io.save(state_root / folder / m, sessions[m].state(next_index, rows[m], {}))
        meta = {"next_index": next_index, "dir": folder, "prompt_ids": [p[1] for p in prompts[:next_index]],
                "fingerprint": fingerprint(cfg), "segments": ctx.segments}
        write_json(state_root / "bench.json", meta, indent=None)
        for old in state_root.glob("at_*"):
            if old.name != folder:
                shutil.rmtree(old, ignore_errors=True)

    log = ctx.open_log()  # metrics.jsonl, and the logger config's sinks (wandb offline by default)

    def result_of(status: str) -> dict[str, Any]:
        done = min((len(r) for r in rows.values()), default=0)
        own_gib = {m: own_memory_gib(sessions[m], shared.values()) for m in methods}  # optimiser state exists now
        return {
            "methods": {m: {**bench_summary(rows[m][:done]), "mem/own_gib": own_gib[m]} for m in methods}
            if done else {},
            "per_task": {t: {m: {**bench_summary([r for r in rows[m][:done] if r["task"] == t]),
                                 "mem/own_gib": own_gib[m]} for m in methods}
                         for t in b.tasks if any(r["task"] == t for r in rows[methods[0]][:done])} if done else {},
            "status": status, "n_prompts": done, "tasks": list(b.tasks), "limit_per_task": int(b.limit),
            "resumed_at": ctx.resumed_at,
            "target": cfg.target.name, "drafter": cfg.drafter.name if cfg.drafter is not None else None,
            "max_new_tokens": n_new, "temperature": float(cfg.method.temperature),
            "method_overrides": to_plain(b.method_overrides), "variants": to_plain(b.variants) if b.get("variants") else {},
            "task_overrides": to_plain(b.task_overrides), "process_peak_rss_gib": peak_rss_gib(),
            "provenance": ctx.prov,
        }

    with ctx.finishing(result_of, write=lambda result: write_outputs(result, Path(b.out_dir), b.name, run_dir)):
        profile = bool(b.profile)
        bar = tqdm(total=len(prompts) * len(methods), initial=start * len(methods), desc="bench", unit="gen",
                   disable=not cfg.progress)
        for i, (task, rid, ids) in enumerate(prompts):
            if i < start:
                continue
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            outs = {}
            for m in order:
                s = sessions[m]
                models = [s.target.model] + ([s.draft_lm.model] if s.draft_lm is not None else [])
                seed = int(cfg.seed) * 1_000_003 + i
                s.set_task(task)  # sessions are built from the first task's config; presets follow the prompt
                if profile:
                    with ForwardTimer(models) as ft:
                        res = s.generate(ids, seed=seed, max_new_tokens=n_new)
                    fwd = ft.forward_s
                else:
                    res, fwd = s.generate(ids, seed=seed, max_new_tokens=n_new), None
                outs[m] = (res, fwd, rss_gib())
                bar.update(1)
            ar = outs["ar"][0]
            certified: dict[int, dict] = {}  # by first differing position: methods often part from ar at the same one
            for m in methods:
                res, fwd, rss = outs[m]
                upd = sessions[m].after_prompt(i)
                row = bench_row(m, task, rid, i, res, ar, forward_s=fwd, rss_gib=rss, update=upd)
                at = first_divergence(res.tokens, ar.tokens) if greedy else None
                if at is not None:  # a low-precision near-tie, or a bug? (outside the timings)
                    if at not in certified:
                        certified[at] = certify(target.model, ids, res.tokens, ar.tokens) or {}
                    row.update(certified[at])
                rows[m].append(row)
                log.log(row, step=i, sink_prefix=f"{m}/")
            if ctx.checkpoint_due(i, len(prompts)):
                checkpoint(i + 1)
        bar.close()
    return ctx.summary


def _stem(result: dict[str, Any], name: str | None) -> str:
    if name:
        return name
    date = dt.date.today().isoformat()
    return f"{date}_{result['target']}-{result['drafter']}_{'-'.join(result['tasks'])}"


def write_outputs(result: dict[str, Any], out_dir: Path, name: str | None, run_dir: Path) -> Path:
    """JSON + Markdown table (the table is generated from the JSON, never typed)."""
    stem = _stem(result, name)
    for d in (out_dir, run_dir):
        d.mkdir(parents=True, exist_ok=True)
        write_json(d / f"{stem}.json", result)
        (d / f"{stem}.md").write_text(bench_markdown(result))
    return out_dir / f"{stem}.json"
