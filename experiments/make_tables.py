"""Markdown tables generated from result files (never typed by hand).

    .venv/bin/python experiments/make_tables.py core        # results/core/*/summary.json -> results/core/table.md
    .venv/bin/python experiments/make_tables.py adaptive    # results/adaptive/*/summary.json -> results/adaptive/table.md
    .venv/bin/python experiments/make_tables.py bench       # results/bench/runs/*/metrics.jsonl -> results/bench/table.md

Each table is followed by one of per-50-prompt blocks (acceptance, mean accepted length, mean draft
length, speedup over the block's prompts that measured ar), computed from metrics.jsonl.

A summary written while its stream was still running (or without one: the stream's
metrics.jsonl alone) is summarised from metrics.jsonl and marked partial. "gain first/last
window" is a run's acceptance minus its reference run's (spd_dm; sv_fixed or the cross-vocab
omnidraft for the adaptive table) on the same prompts, so prompt difficulty cancels out. The CPU
column is torch's capability per segment and the dtype column the target's (bf16 is emulated,
several times slower, on CPUs without AVX512-BF16/AMX: speedups from such runs are not comparable).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = {"core": ["spd_dm", "cache_pp", "dm_only", "omnidraft", "lora"],
         "adaptive": ["sv_fixed", "sv_heuristic", "sv_joint", "sv_interleaved", "xv_fixed", "xv_joint"]}
ALIAS = {("adaptive", "xv_fixed"): ("core", "omnidraft")}  # the same stream serves both tables
# Later GSM8K prompts are harder for every drafter, so a run's last window vs its first mixes
# learning with prompt difficulty. "gain" columns subtract the frozen drafter's acceptance on the
# SAME prompts (by prompt index) in each window: the frozen drafter for the core runs, the
# fixed-k run of the same pair for the adaptive ones.
REFERENCE = {"core": lambda name: ("core", "spd_dm"),
             "adaptive": lambda name: ("adaptive", "sv_fixed") if name.startswith("sv_") else ("core", "omnidraft")}
COLS = {
    "core": [("prompts", "n_prompts", "d"), ("acc first window", "accept/rate_first_window", ".3f"),
             ("acc last window", "accept/rate_last_window", ".3f"), ("acc all", "accept/rate", ".3f"),
             ("mean accepted len", "accept/mean_len", ".2f"), ("speedup", "speed/speedup", ".2f"),
             ("n-gram hits/step", "ngram/hits_per_step", ".3f"), ("cache size", "ngram/size", "d"),
             ("updates", "adapt/n_updates", "d"), ("update share", "adapt/time_share", ".1%"),
             ("equal to ar", "lossless/match_rate", ".2f")],
    "adaptive": [("prompts", "n_prompts", "d"), ("acc", "accept/rate", ".3f"),
                 ("acc last window", "accept/rate_last_window", ".3f"), ("mean accepted len", "accept/mean_len", ".2f"),
                 ("mean draft len", "draft/mean_len", ".2f"), ("speedup", "speed/speedup", ".2f"),
                 ("head pred", "head/pred_accept", ".3f"),
                 ("head pred debiased", "head/pred_accept_debiased", ".3f"), ("head obs", "head/obs_accept", ".3f"),
                 ("equal to ar", "lossless/match_rate", ".2f")],
}


def load(run: Path) -> tuple[dict, bool]:
    """(summary, partial). Summaries are recomputed from metrics.jsonl when the run is unfinished."""
    sys.path.insert(0, str(ROOT))
    from omnidraft.tables import summarise

    s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    if "provenance" not in s and (run / "provenance.json").exists():  # written when the run started
        s["provenance"] = json.loads((run / "provenance.json").read_text())
    rows = _rows(run)
    done = s.get("status") == "ok" and s.get("n_prompts") == len(rows)
    if not done and rows:
        s = {**s, **summarise(rows, True, 50)}
    return s, not done


def _rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _rate(rows: list[dict]) -> float | None:
    prop = sum(r.get("sd/proposed") or 0 for r in rows)
    return sum(r.get("sd/accepted") or 0 for r in rows) / prop if prop else None


def gains(rows: list[dict], ref: list[dict], window: int) -> tuple[float | None, float | None]:
    """(first-window, last-window) acceptance minus the reference run's on the same prompts."""
    by_index = {r["prompt/index"]: r for r in ref}
    w = max(1, min(window, len(rows) // 2))
    out = []
    for part in (rows[:w], rows[-w:]):
        if not part or any(r["prompt/index"] not in by_index for r in part):
            out.append(None)
            continue
        a, b = _rate(part), _rate([by_index[r["prompt/index"]] for r in part])
        out.append(None if a is None or b is None else a - b)
    return out[0], out[1]


def cpu(s: dict) -> str:
    """The CPU ISA each segment ran on (speedups from different ISAs are not comparable:
    bf16 is native with AVX512-BF16 and emulated, several times slower, on AVX2)."""
    from omnidraft.data.models import native_bf16

    prov = s.get("provenance") or {}
    segs = prov.get("segments") or [prov]
    if len(segs) == 1 and "cpu_flags" not in segs[0]:  # segments recorded flags only later
        segs = [{**segs[0], "cpu_flags": prov.get("cpu_flags")}]

    def isa(g: dict) -> str:
        cap, flags = g.get("cpu_capability") or "unrecorded", g.get("cpu_flags")
        if flags is not None and native_bf16("cpu", set(flags)):
            cap += "-BF16"  # torch reports AVX512 with or without native bf16
        return cap

    return "+".join(dict.fromkeys(isa(g) for g in segs))


def dtype(run: Path) -> str:
    """The target's dtype as the run resolved it (config.yaml; `auto` is resolved before it is
    written): with the CPU column it says which kernels the speedup came from."""
    f = run / "config.yaml"
    if not f.exists():
        return "-"
    from omegaconf import OmegaConf

    return str(OmegaConf.load(f).target.dtype).replace("bfloat16", "bf16").replace("float32", "fp32")


def fmt(v, f: str) -> str:
    if v is None:
        return "-"
    return format(int(v), "d") if f == "d" else format(v, f)


def table(group: str) -> str:
    runs = [ROOT / "results" / Path(*ALIAS.get((group, n), (group, n))) for n in ORDER[group]]
    cols = COLS[group]
    lines = ["| run | " + " | ".join(c for c, _, _ in cols) + " | reference | gain first window | gain last window | CPU | dtype |",
             "|" + "---|" * (len(cols) + 6)]
    for short, run in zip(ORDER[group], runs):
        ref_dir = ROOT / "results" / Path(*REFERENCE[group](short))
        ref = _rows(ref_dir)
        if not (run / "metrics.jsonl").exists():
            lines.append(f"| {run.name} | " + " | ".join("not run" if i == 0 else "" for i in range(len(cols) + 5)) + " |")
            continue
        s, partial = load(run)
        name = run.name if run.parent.name == group else f"{run.parent.name}/{run.name}"
        name += " (partial)" if partial else ""
        g = gains(_rows(run), ref, int(s.get("accept/window") or 50)) if ref else (None, None)
        lines.append(f"| {name} | " + " | ".join(fmt(s.get(k), f) for _, k, f in cols) + f" | {ref_dir.name}"
                     + "".join(f" | {fmt(x, '+.3f')}" for x in g) + f" | {cpu(s)} | {dtype(run)} |")
    return "\n".join(lines) + "\n"


def blocks(group: str, size: int = 50) -> str:
    """Per block of ``size`` prompts (by prompt index): acceptance, mean accepted length (tokens
    per target forward) and mean draft length (drafter tokens per step) of every run with rows,
    and the speedup over the block's prompts that measured ar; sums over the block, not means."""
    runs = [(n, ROOT / "results" / Path(*ALIAS.get((group, n), (group, n)))) for n in ORDER[group]]
    runs = [(n, r) for n, r in runs if (r / "metrics.jsonl").exists()]
    if not runs:
        return ""
    n_max = max(max(x["prompt/index"] for x in _rows(r)) + 1 for _, r in runs)
    lines = [f"Per {size}-prompt block: acceptance / mean accepted len / mean draft len / speedup", "",
             "| prompts | " + " | ".join(n for n, _ in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for lo in range(0, n_max, size):
        cells = []
        for _, r in runs:
            rows = [x for x in _rows(r) if lo <= x["prompt/index"] < lo + size]
            steps = sum(x.get("sd/steps") or 0 for x in rows)
            if not rows or not steps:
                cells.append("-")
                continue
            new = sum(x["sd/new_tokens"] for x in rows)
            drafted = sum((x.get("draft/mean_len") or 0) * x["sd/steps"] for x in rows)
            ar = [x for x in rows if x.get("ar/wall_s")]
            sp = (sum(x["sd/new_tokens"] for x in ar) / sum(x["sd/wall_s"] for x in ar)) / \
                (sum(x["ar/new_tokens"] for x in ar) / sum(x["ar/wall_s"] for x in ar)) if ar else None
            cells.append(f"{fmt(_rate(rows), '.3f')} / {new / steps:.2f} / {drafted / steps:.2f} / {fmt(sp, '.2f')}"
                         + ("" if len(rows) == size else f" ({len(rows)})"))
        lines.append(f"| {lo}-{lo + size - 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def head_intervals(group: str, size: int = 8) -> str:
    """Runs with an acceptance head, per ``size`` prompts (the distillation interval): draft length,
    acceptance and the head's mean prediction (raw, debiased) vs the observed acceptance, so the
    effect of each update on the stop rule shows."""
    out = []
    for n in ORDER[group]:
        run = ROOT / "results" / Path(*ALIAS.get((group, n), (group, n)))
        rows = [x for x in _rows(run) if x.get("head/n")]
        if not rows:
            continue
        out += [f"{n}: per {size} prompts, drafter tokens per step / acceptance / head raw / debiased / observed", "",
                "| prompts | draft len | acc | head raw | head debiased | observed |", "|---|---|---|---|---|---|"]
        for lo in range(0, len(rows), size):
            rs = rows[lo: lo + size]
            steps = sum(x["sd/steps"] for x in rs) or 1
            w = sum(x["head/n"] for x in rs)
            def mean(k: str) -> str:  # rows written before a key existed lack it
                if not all(k in x for x in rs):
                    return "-"
                return f"{sum(x[k] * x['head/n'] for x in rs) / w:.3f}"

            out.append(f"| {rs[0]['prompt/index']}-{rs[-1]['prompt/index']} | "
                       f"{sum((x.get('draft/mean_len') or 0) * x['sd/steps'] for x in rs) / steps:.2f} | "
                       f"{fmt(_rate(rs), '.3f')} | {mean('head/pred_accept')} | "
                       f"{mean('head/pred_accept_debiased')} | {mean('head/obs_accept')} |")
        out.append("")
    return "\n".join(out)


BENCH_COLS = [("speedup", "speed/speedup", ".2f"), ("tok/s", "speed/tok_per_s", ".2f"), ("acc", "accept/rate", ".3f"),
              ("mean accepted len", "accept/mean_len", ".2f"), ("equal to ar", "lossless/match_rate", ".2f"),
              ("overhead", "overhead/share", ".1%")]


def bench_table() -> str:
    """The issue-6 bench: one bench process per task (results/bench/runs/<task>/, each with every
    method interleaved per prompt), a column block per task and one over all prompts (ratios of
    totals over the rows, as the bench computes them), then the issue's targets checked."""
    sys.path.insert(0, str(ROOT))
    from omnidraft.bench import _agg

    runs = sorted(d for d in (ROOT / "results" / "bench" / "runs").glob("*") if (d / "metrics.jsonl").exists())
    if not runs:
        return "no bench runs under results/bench/runs/\n"
    rows = [r for d in runs for r in _rows(d)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))

    def done(task: str | None) -> list[dict]:  # prompts every method finished (a cut bench can end mid-prompt)
        rs = [r for r in rows if task is None or r["task"] == task]
        keys = [{(r["task"], r["prompt/index"]) for r in rs if r["method"] == m} for m in methods]
        ok = set.intersection(*keys) if keys else set()
        return [r for r in rs if (r["task"], r["prompt/index"]) in ok]

    parts = [(t, done(t)) for t in tasks] + ([("all", done(None))] if len(tasks) > 1 else [])
    aggs = {name: {m: _agg([r for r in rs if r["method"] == m]) for m in methods} for name, rs in parts if rs}
    head = "| method | " + " | ".join(f"{name} {c}" for name in aggs for c, _, _ in BENCH_COLS) + " |"
    lines = []
    for d in runs:  # where and how each bench process ran
        s = {"provenance": json.loads((d / "provenance.json").read_text())} if (d / "provenance.json").exists() else {}
        g = s.get("provenance", {})
        lines.append(f"- {d.name}: git {str(g.get('git_hash'))[:10]}{' (dirty)' if g.get('git_dirty') else ''}, "
                     f"{g.get('cpu')} ({cpu(s)}), torch threads {g.get('torch_threads')}, target dtype {dtype(d)}")
    lines += ["", "prompts per block: " + ", ".join(f"{name} {a[methods[0]]['n_prompts']}" for name, a in aggs.items()),
              "", head, "|" + "---|" * (1 + len(aggs) * len(BENCH_COLS))]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(fmt(aggs[name][m].get(k), f) for name in aggs for _, k, f in BENCH_COLS)
                     + " |")
    lines += ["", "Targets (issue 6), per block:", ""]
    for name, a in aggs.items():
        sp = {m: a[m]["speed/speedup"] for m in methods}
        checks = []
        if "spd_dm" in sp and "uag_k5" in sp:
            checks.append(f"spd_dm {sp['spd_dm']:.2f}x vs uag_k5 {sp['uag_k5']:.2f}x: "
                          f"{'met' if sp['spd_dm'] >= sp['uag_k5'] else 'missed'} ({sp['spd_dm'] / sp['uag_k5']:.2f}x)")
        for u in ("uag", "uag_k5"):
            if "omnidraft" in sp and u in sp:
                r = sp["omnidraft"] / sp[u]
                checks.append(f"omnidraft / {u} {r:.2f} (target >= 1.3: {'met' if r >= 1.3 else 'missed'})")
        over = {m: a[m]["overhead/share"] for m in methods if m != "ar" and a[m]["overhead/share"] is not None}
        if over:
            worst = max(over, key=over.get)
            checks.append(f"largest overhead {over[worst]:.1%} ({worst}; target <= 10%: "
                          f"{'met' if over[worst] <= 0.10 else 'missed'})")
        lines.append(f"- {name}: " + "; ".join(checks))
    for name, rs in parts:  # where the time goes: the decode loop's draft/verify split, per step
        if not rs or name == "all" or any("draft_s" not in r for r in rs):
            continue  # rows of benches older than the split lack it
        lines += ["", f"Time per step, {name} (draft and verify phases as the decode loop times them; uag: between "
                  "and in the target's forwards):", "",
                  "| method | steps | draft s/step | verify s/step | drafted tok/step | draft s/drafted tok | wall s/token |",
                  "|---|---|---|---|---|---|---|"]
        for m in methods:
            mr = [r for r in rs if r["method"] == m]
            tot = {k: sum(r[k] for r in mr) for k in ("steps", "draft_s", "target_s", "proposed", "wall_s", "new_tokens")}
            st, pr = max(1, tot["steps"]), tot["proposed"]
            lines.append(f"| {m} | {tot['steps']} | {tot['draft_s'] / st:.3f} | {tot['target_s'] / st:.3f} | "
                         f"{pr / st:.2f} | {tot['draft_s'] / pr if pr else 0:.3f} | "
                         f"{tot['wall_s'] / max(1, tot['new_tokens']):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    group = sys.argv[1] if len(sys.argv) > 1 else "core"
    if group not in ORDER and group != "bench":
        sys.exit(f"make_tables: unknown group {group!r}; use one of {', '.join(ORDER)}, bench")
    out = ROOT / "results" / group / "table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    if group == "bench":
        text = bench_table()
    else:
        text = table(group)
        text += "\n" + blocks(group)
    if group == "adaptive":
        text += "\n" + head_intervals(group)
    out.write_text(text)
    print(text)
