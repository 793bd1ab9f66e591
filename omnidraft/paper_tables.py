"""The paper's tables from a sweep's result files, beside the paper's numbers.

``omnidraft tables <sweep or results dir>`` reads every run directory under the directory (its
``summary.json``, ``config.yaml`` and ``metrics.jsonl``), groups the runs of each paper experiment
(``conf/experiment/paper/<name>.yaml``: the run's ``choices.experiment``) into the paper table's
cells (row x column x target), pools the test prompts of a cell over its seeds and writes, per
experiment, ``<dir>/<name>.md`` and ``<dir>/<name>.tex`` (our numbers with 95% bootstrap intervals
over the pooled test prompts and n, the paper's numbers from :data:`PAPER_FILE` beside them) and the
plots (PNG): acceptance over the train stream with the test-set evaluations (the paper's Figure 2),
loss curves, n-gram cache growth, the draft-length distribution and the speedup by column.

Metrics, as the paper counts them: acceptance rate = accepted / proposed target tokens (ratio of
totals over the cell's test prompts), speedup = the Medusa-convention modelled speedup
(``speed/modelled_speedup``: replays from this machine's latency calibration, live runs from their
measured step times, :func:`omnidraft.tables.modelled_speedup`). A cell's test rows are those of
its last evaluation (after training).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnidraft.errors import OmniDraftError
from omnidraft.tables import read_rows, read_summary, summarise

PAPER_FILE = Path(__file__).with_name("paper_numbers.json")
BOOTSTRAP = 2000  # resamples per interval
# Table 6's columns are temperatures; at CPU scale T=0.01 runs greedy (replay), shown in that column.
GREEDY_AS = {"method.temperature": 0.01}
# an experiment that reports into another table's layout
TABLE_OF = {"table6_t1": "table6"}
LABELS = {
    "spd_dm": "SpD_DM", "sd": "SpD", "l_dm": "L_DM", "hybrid": "L_DM + λ L_Ngram", "hybrid_lora": "+ LoRA",
    "osd": "OSD (not in the paper)", "distillspec": "DistillSpec (not in the paper)",
    "cache_pp": "SpD_DM + cache (pp)", "l_dm_cache": "L_DM + cache",
    "loss_nll_only": "NLL on n-grams only", "loss_nll_nll": "NLL DM + NLL n-gram", "loss_kl_kl": "KL DM + KL n-gram",
    "head_only": "adapt only", "distill_only": "distill only", "joint": "joint", "interleaved": "interleaved",
    "evict_lru_quarter": "1/4 cache, LRU", "evict_lfu_quarter": "1/4 cache, LFU", "evict_lru_half": "1/2 cache, LRU",
    "evict_lfu_half": "1/2 cache, LFU",
}
TARGET_NAMES = {"llama3_8b": "Llama3-8B", "qwen2_7b": "Qwen2-7B", "vicuna_7b": "Vicuna-7B", "qwen25_7b": "Qwen2.5-7B",
                "qwen25_14b": "Qwen2.5-14B", "qwen25_32b": "Qwen2.5-32B", None: "paper"}


def paper_numbers() -> dict[str, Any]:
    """The paper's numbers (``omnidraft/paper_numbers.json``: source, metrics and one entry per table)."""
    return json.loads(PAPER_FILE.read_text(encoding="utf-8"))


def spec_of(name: str) -> dict[str, Any]:
    """The paper table an experiment reports into (``paper/<name>``: its layout and the paper's
    numbers); an experiment without a paper table gets an empty one laid out by task."""
    if name == "target_switch":  # a switching stream and its single-target controls: one column per schedule
        return {"title": "target switch (App. B.6; per-segment figures below)", "cols": "target_switch.targets",
                "rows": [], "cells": []}
    if name == "task_switch":  # a stream per order of the two tasks: one column each
        return {"title": "task switch (App. B.6; per-segment figures below)", "cols": "task.components",
                "rows": [], "cells": []}
    return paper_numbers()["tables"].get(TABLE_OF.get(name, name)) or {
        "title": f"{name} (no table in the paper)", "cols": "task", "rows": [], "cells": []}


@dataclass
class Run:
    """One run directory of a sweep."""

    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    experiment: str | None
    row: str | None
    seed: int
    status: str
    error: str | None = None
    speed_machine: str | None = None  # the machine whose calibration re-modelled its speed (remodel_speed)

    def get(self, dotted: str) -> Any:
        """A value of the run's resolved config by dotted key (None when absent)."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


@dataclass
class Cell:
    """The runs of one table cell (one per seed), its pooled test rows (the last evaluation's) and,
    where its runs evaluated the test set more than once (Figure 2), each evaluation's pooled rows
    keyed by ``eval/at`` (train prompts seen)."""

    target: str
    row: str
    col: Any
    runs: list[Run] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def seeds(self) -> list[int]:
        return sorted({r.seed for r in self.runs})

    @property
    def seed_independent(self) -> bool:
        """Frozen greedy cells run at seed 0 only (the sweep skips the other seeds)."""
        return all(not _learns(r) for r in self.runs) and all(_greedy(r) for r in self.runs)


def _learns(run: Run) -> bool:
    m = run.config.get("method") or {}
    head = (m.get("draft_length") or {}).get("policy") == "head" and (m.get("draft_length") or {}).get("head_learn")
    distils = m.get("needs_init_state") and run.config.get("protocol") == "train_test" and \
        run.summary.get("train/distill") is not None
    return bool((m.get("can_adapt") and (m.get("adapt") or {}).get("enabled")) or head or distils)


def _greedy(run: Run) -> bool:
    return float((run.config.get("method") or {}).get("temperature") or 0) <= 0


def _load_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    if not path.is_file():
        return {}
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def read_runs(root: Path) -> list[Run]:
    """Every run directory under ``root`` (one with a ``summary.json``, ``config.yaml`` or ``error.txt``)."""
    found = {p.parent for pat in ("summary.json", "error.txt") for p in root.rglob(pat) if "state" not in p.parent.parts}
    # a run's own sub-runs (DistillSpec's distillation in <run>/distill) are part of it
    dirs = sorted(d for d in found if not any(a in found for a in d.parents))
    runs = []
    for d in dirs:
        s = read_summary(d)
        cfg = _load_yaml(d / "config.yaml")
        choices = s.get("choices") or {}
        err = (d / "error.txt").read_text(encoding="utf-8").splitlines()[0] if (d / "error.txt").is_file() else None
        runs.append(Run(d, s, cfg, choices.get("experiment"), choices.get("row"), int(cfg.get("seed", 0) or 0),
                        s.get("status", "failed" if err else "unknown"), err))
    return runs


def test_rows(run: Run) -> list[dict[str, Any]]:
    """The rows of a run's last evaluation on the test prompts (protocol=train_test); a stream run's
    rows as they are."""
    rows = read_rows(run.path)
    evals = _evals(rows)
    return evals[max(evals)] if evals else [r for r in rows if r.get("phase", "train") == "train"]


def _evals(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """A train_test run's test rows per evaluation, keyed by ``eval/at`` (train prompts seen before it)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("phase") == "test":
            out.setdefault(int(r["eval/at"]), []).append(r)
    return out


def col_value(run: Run, key: str) -> Any:
    """The run's value of the table's column key (``task`` or a dotted config key)."""
    if key == "task":
        return run.summary.get("task") or run.get("task.name")
    v = run.get(key)
    if isinstance(v, list):  # a schedule (target_switch.targets): hashable, readable
        return " > ".join(str(x) for x in v) if v else "–"
    if key in GREEDY_AS and v is not None and float(v) <= 0:
        return GREEDY_AS[key]
    return v


def cells_of(runs: list[Run], spec: dict[str, Any], speed_machine: str | None = None) -> dict[tuple[str, str, Any], Cell]:
    """Group finished runs into cells keyed (target, row, column value), pooling test rows over seeds;
    with ``speed_machine``, each replay's speed modelled again under that machine's calibration
    (:func:`remodel_speed`)."""
    cells: dict[tuple[str, str, Any], Cell] = {}
    every: dict[tuple[str, str, Any], list[tuple[Run, dict[int, list[dict[str, Any]]]]]] = {}
    for run in runs:
        if run.status != "ok":
            continue
        key = (run.summary.get("target") or run.get("target.name"), run.row or run.summary.get("method"),
               col_value(run, spec["cols"]))
        cell = cells.setdefault(key, Cell(*key))
        cell.runs.append(run)
        rows = read_rows(run.path)
        evals = _evals(rows) or {-1: [r for r in rows if r.get("phase", "train") == "train"]}  # -1: a stream's rows
        if speed_machine:
            evals = {at: remodel_speed(run, rs, speed_machine) for at, rs in evals.items()}
        cell.rows.extend({**r, "_seed": run.seed} for r in evals[max(evals)])
        every.setdefault(key, []).append((run, evals))
    for key, ran in every.items():  # a cell one of whose runs evaluated more than once: every run's evaluations,
        if any(len(evals) > 1 for _, evals in ran):  # so its last pools the seeds the cell does
            for run, evals in ran:
                for at, rs in evals.items():
                    cells[key].evals.setdefault(at, []).extend({**r, "_seed": run.seed} for r in rs)
    return cells


def remodel_speed(run: Run, rows: list[dict[str, Any]], machine: str) -> list[dict[str, Any]]:
    """A replay's rows with their modelled speed (``speed/modelled_*``) computed again from the step
    shapes they record (:func:`omnidraft.replay.row_shapes`) under ``machine``'s latency calibration
    of the same pair, dtypes and threads (the run's calibration file, named for that machine), and
    ``run.speed_machine`` set. Acceptance is machine-independent in replay; this makes speed so too,
    so cells run on different machines compare. Rows as they are for a live run, a target-switch run
    (one calibration per target) or rows written before rows recorded their shapes.

    Raises:
        OmniDraftError: that machine has no such calibration (with the command that makes it).
    """
    from omnidraft.calibrate import calibrate_command, load_calibration
    from omnidraft.replay import row_shapes, speed_keys

    s = run.summary
    own = s.get("replay/calibration")
    if s.get("engine") != "replay" or not own or s.get("targets") or not rows:
        return rows
    shapes = [row_shapes(r) for r in rows]
    if any(sh is None for sh in shapes):
        return rows
    own = Path(own)
    path = own.with_name(f"{machine}_{own.name.split('_', 1)[1]}")
    if not path.is_file():
        t, d = str(run.get("target.dtype")), str(run.get("drafter.dtype"))
        raise OmniDraftError(f"--speed-machine={machine}: no calibration {path} (for {run.path}); make it on that "
                             f"machine with `{calibrate_command(str(s.get('target')), str(s.get('drafter')), t, d)}`, "
                             "or leave --speed-machine out")
    cal = load_calibration(path)
    cal.extrapolate = True  # as the replay did (omnidraft.replay.machine_calibration)
    run.speed_machine = cal.machine or machine
    return [{**r, **speed_keys(cal, sh, int(r["sd/new_tokens"]))} for r, sh in zip(rows, shapes)]


# ------------------------------------------------------------------------------ statistics


def _vectors(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per-row totals the cell's ratios are made of (the modelled speedup's from
    :func:`omnidraft.tables.summarise`'s two branches: a replay's calibration, a live run's step times)."""
    def col(k: str) -> np.ndarray:
        return np.array([float(r.get(k) or 0.0) for r in rows])

    v = {"acc": col("sd/accepted"), "prop": col("sd/proposed"), "new": col("sd/new_tokens"), "steps": col("sd/steps")}
    if rows and all("speed/modelled_sd_s" in r for r in rows):
        # plain decoding of a row: its new tokens, each one plain step of its own target on its own machine
        v["sd_s"] = col("speed/modelled_sd_s")
        v["ar_s"] = v["new"] * col("speed/modelled_ar_step_s")
        v["ar_steps"] = v["new"].copy()
    elif rows and all("ar/steps" in r for r in rows):
        v["sd_s"] = col("sd/draft_s") + col("sd/target_s")
        v["ar_s"] = col("ar/target_s")
        v["ar_steps"] = col("ar/steps")
    return v


def _stats(v: dict[str, np.ndarray], idx: np.ndarray) -> tuple[float, float]:
    """(acceptance, modelled speedup) of the rows ``idx`` (resampled indices, shape (B, n) or (n,))."""
    acc = v["acc"][idx].sum(-1) / np.maximum(v["prop"][idx].sum(-1), 1e-12)
    if "sd_s" not in v:
        return acc, np.full_like(acc, np.nan)
    # (new / steps) / ((sd_s / steps) / (ar_s / ar_steps)) = new * ar_s / (sd_s * ar_steps)
    sp = v["new"][idx].sum(-1) * v["ar_s"][idx].sum(-1) / np.maximum(
        v["sd_s"][idx].sum(-1) * v["ar_steps"][idx].sum(-1), 1e-12)
    return acc, sp


def cell_stats(cell: Cell, n_boot: int = BOOTSTRAP, seed: int = 0) -> dict[str, Any]:
    """A cell's acceptance and modelled speedup with 95% percentile-bootstrap intervals over its test
    prompts pooled over seeds (each resample draws n rows with replacement from the pooled rows).

    Returns:
        ``acc``, ``acc_ci``, ``speedup``, ``speedup_ci`` (None without a speed model), ``n`` (rows),
        ``seeds``, ``seed_independent``, ``ngram_hits_per_step``, ``ngram_size`` (mean over seeds);
        where the cell's runs evaluated the test set more than once, ``evals``: one entry per
        evaluation in training order (:func:`eval_stats`).
    """
    rows = cell.rows
    s = summarise(rows, greedy=True) if rows else {}
    out: dict[str, Any] = {"n": len(rows), "seeds": cell.seeds, "seed_independent": cell.seed_independent,
                           "acc": s.get("accept/rate"), "speedup": s.get("speed/modelled_speedup"),
                           "ngram_hits_per_step": s.get("ngram/hits_per_step"), "acc_ci": None, "speedup_ci": None,
                           "mean_len": s.get("accept/mean_len")}
    sizes = [r.summary.get("train/ngram/size") for r in cell.runs if r.summary.get("train/ngram/size") is not None]
    out["ngram_size"] = float(np.mean(sizes)) if sizes else None
    # the machine whose latency calibration modelled the speedup (replay): speeds compare within one only
    out["calibration"] = sorted({str(m) for r in cell.runs
                                 if (m := r.speed_machine or r.summary.get("replay/calibration_machine"))})
    if len(rows) >= 2:
        v = _vectors(rows)
        idx = np.random.default_rng(seed).integers(0, len(rows), size=(n_boot, len(rows)))
        acc, sp = _stats(v, idx)
        out["acc_ci"] = tuple(float(x) for x in np.percentile(acc, [2.5, 97.5]))
        if not np.isnan(sp).all():
            out["speedup_ci"] = tuple(float(x) for x in np.percentile(sp, [2.5, 97.5]))
    if len(cell.evals) > 1:
        out["evals"] = [eval_stats(cell, at, n_boot, seed) for at in sorted(cell.evals)]
    return out


_STEP_KEYS = ("sd/accepted", "sd/proposed", "sd/steps", "sd/new_tokens", "sd/step_accepted", "sd/step_proposed")


def eval_stats(cell: Cell, at: int, n_boot: int = BOOTSTRAP, seed: int = 0) -> dict[str, Any]:
    """One test-set evaluation of a cell (Figure 2's points: after ``at`` train prompts), its rows
    pooled over the seeds that ran it, as :func:`cell_stats` pools the last. Where every seed's rows
    are the same steps (before training, a greedy drafter no seed has touched), one seed's rows
    count: copies would narrow the interval without adding a prompt.

    Returns:
        ``at``, ``acc``, ``acc_ci``, ``speedup``, ``speedup_ci``, ``n``, ``seeds``, ``calibration``,
        ``identical`` (the seeds' rows were the same, n counts one seed's).
    """
    rows = cell.evals[at]
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(r["_seed"], []).append(r)
    steps = {json.dumps([[r.get("prompt/index"), r.get("prompt/turn"), *(r.get(k) for k in _STEP_KEYS)] for r in rs])
             for rs in by_seed.values()}
    identical = len(by_seed) > 1 and len(steps) == 1
    runs = [r for r in cell.runs if r.seed in by_seed]
    st = cell_stats(Cell(cell.target, cell.row, cell.col, runs, by_seed[min(by_seed)] if identical else rows),
                    n_boot, seed)
    return {"at": at, **{k: st[k] for k in ("acc", "acc_ci", "speedup", "speedup_ci", "n", "seeds", "calibration")},
            "identical": identical}


def separated(a: dict[str, Any], b: dict[str, Any], key: str = "acc") -> bool | None:
    """Whether two cells' 95% intervals of ``key`` do not overlap (None without both intervals)."""
    ca, cb = a.get(f"{key}_ci"), b.get(f"{key}_ci")
    if ca is None or cb is None:
        return None
    return ca[1] < cb[0] or cb[1] < ca[0]


# ------------------------------------------------------------------------------ rendering


def _num(x: float | None, f: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)


def _ci(ci: tuple[float, float] | None, f: str = ".3f") -> str:
    return "" if ci is None else f" [{ci[0]:{f}}, {ci[1]:{f}}]"


def _paper_cell(spec: dict[str, Any], row: str, col: Any) -> str:
    hits = [c for c in spec["cells"] if c["row"] == row and str(c["col"]) == str(col)]
    parts = []
    for c in hits:
        who = TARGET_NAMES.get(c.get("target"), c.get("target"))
        fig = f"{c['acc']:.3g}" if "acc" in c else ""
        if "speedup" in c:
            fig += f" / {c['speedup']:.2f}x"
        if "ngram_hits_per_step" in c and spec["cols"] == "method.k":
            fig += f" / {c['ngram_hits_per_step']:.2f} hits"
        parts.append(f"{fig} ({who})" if len(hits) > 1 or c.get("target") else fig)
    return "; ".join(parts) if parts else "–"


def _order(spec: dict[str, Any], cells: dict) -> tuple[list[str], list[Any], list[str]]:
    rows = list(spec.get("rows") or [])
    rows += sorted({k[1] for k in cells} - set(rows))
    cols_paper = [c["col"] for c in spec["cells"]]
    cols = list(dict.fromkeys([*cols_paper, *sorted({k[2] for k in cells}, key=str)]))
    cols = [c for c in cols if any(str(k[2]) == str(c) for k in cells)] or cols
    targets = sorted({k[0] for k in cells})
    return rows, cols, targets


def render_markdown(name: str, spec: dict[str, Any], cells: dict, stats: dict, failed: list[Run],
                    provenance: dict[str, Any], runs_all: list[Run] | None = None) -> str:
    """One experiment's table: per target of ours, rows x columns, our acceptance and modelled speedup
    (95% CI, n) beside the paper's."""
    rows, cols, targets = _order(spec, cells)
    src = paper_numbers()["source"]
    out = [f"# {spec['title']}", "",
           f"Generated by `omnidraft tables` from the run directories of experiment `paper/{name}`; paper numbers: "
           f"{src} (transcribed in `omnidraft/paper_numbers.json`).", "",
           "Cells: acceptance rate (accepted / proposed target tokens) and modelled speedup (Medusa convention) on "
           f"{_cells_over(provenance)}, 95% percentile bootstrap over {_boot_over(provenance)} pooled over seeds "
           f"[in brackets], n = {_boot_over(provenance)} x seeds. Frozen greedy cells ran once (seed-independent, "
           "marked *).", ""]
    if spec.get("note"):
        out += [f"Note: {spec['note']}", ""]
    out += [f"Runs on: {provenance.get('cpu', '?')}; engine {provenance.get('engine', '?')}; "
            f"{provenance.get('dtype', '?')}; {provenance.get('max_new_tokens', '?')} new tokens; "
            f"{_prompts_line(provenance)}.", ""]
    if provenance.get("speed_machine"):
        out += [f"Speedups of replays are modelled with {provenance['speed_machine']}'s latency calibrations "
                f"(`omnidraft tables DIR --speed-machine={provenance['speed_machine']}`), from the step shapes each "
                "row records, so speedups compare across cells run on different machines; runs whose rows predate "
                "step shapes, and target-switch streams, keep their own machine's (marked where it differs).", ""]
    machines = sorted({m for st in stats.values() if st for m in st.get("calibration") or []})
    tag = {m: f" ({chr(ord('a') + i)})" for i, m in enumerate(machines)} if len(machines) > 1 else {}
    if tag:
        out += ["Speedups are modelled from more than one machine's latency calibration, marked per cell: "
                + "; ".join(f"({chr(ord('a') + i)}) {m}" for i, m in enumerate(machines))
                + ". Compare speedups only between cells of one machine; acceptance is the same on any machine "
                "(replay is exact).", ""]
    colname = spec["cols"]
    for tgt in targets:
        out += [f"## target {tgt}", "", f"| row | {colname} | acceptance (ours) | speedup (ours) | n | seeds | paper acc / speedup |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            for c in cols:
                key = next((k for k in cells if k[0] == tgt and k[1] == r and str(k[2]) == str(c)), None)
                st = stats.get(key)
                paper = _paper_cell(spec, r, c)
                if st is None and paper == "–":
                    continue
                if st is None:
                    out.append(f"| {LABELS.get(r, r)} | {c} | not run | | | | {paper} |")
                    continue
                seeds = f"{len(st['seeds'])}{'*' if st['seed_independent'] else ''}"
                out.append(f"| {LABELS.get(r, r)} | {c} | {_num(st['acc'])}{_ci(st['acc_ci'])} | "
                           f"{_num(st['speedup'], '.2f')}{_ci(st['speedup_ci'], '.2f')}"
                           f"{''.join(tag.get(m, '') for m in st.get('calibration') or [])} | {st['n']} | {seeds} | {paper} |")
        out.append("")
    out += render_evals(spec, cells, stats, tag)
    out += render_orderings(spec, cells, stats)
    out += render_segments(runs_all if runs_all is not None else cells_runs(cells))
    if failed:
        out += ["## Failed or unfinished runs", ""]
        out += [f"- `{f.path.name}`: {f.status}{': ' + f.error if f.error else ''}" for f in failed]
        out.append("")
    return "\n".join(out)


def render_evals(spec: dict[str, Any], cells: dict, stats: dict, tag: dict[str, str]) -> list[str]:
    """Figure 2's test-set points as a table: each cell whose runs evaluated the test prompts more
    than once, each evaluation pooled over seeds (:func:`eval_stats`), and whether its interval
    separates from the first evaluation's."""
    rows, cols, targets = _order(spec, cells)
    out: list[str] = []
    for tgt in targets:
        for r in rows:
            for c in cols:
                key = next((k for k in cells if k[0] == tgt and k[1] == r and str(k[2]) == str(c)), None)
                evals = (stats.get(key) or {}).get("evals")
                if not evals:
                    continue
                first = evals[0]
                for e in evals:
                    sep = None if e is first else separated(e, first)
                    vs = "–" if sep is None else ("overlap" if not sep else
                                                  "higher, separated" if e["acc"] > first["acc"] else "lower, separated")
                    out.append(f"| {tgt} | {LABELS.get(r, r)} | {c} | {e['at']} | {_num(e['acc'])}{_ci(e['acc_ci'])} | "
                               f"{_num(e['speedup'], '.2f')}{_ci(e['speedup_ci'], '.2f')}"
                               f"{''.join(tag.get(m, '') for m in e.get('calibration') or [])} | {e['n']} | "
                               f"{len(e['seeds'])}{' (identical)' if e.get('identical') else ''} | {vs} |")
    if not out:
        return []
    return ["## The test set over the train stream", "",
            "Each evaluation of the test prompts after that many train prompts (the drafter frozen while it is "
            "evaluated; the last is the cell above), pooled over the seeds, 95% percentile bootstrap over the test "
            "prompts x seeds (seeds whose rows are the same steps, as before training, marked identical: n counts "
            "one); the last column: whether its acceptance interval separates from the first evaluation's.", "",
            f"| target | row | {spec['cols']} | after train prompts | acceptance | speedup | n | seeds | vs the first |",
            "|---|---|---|---|---|---|---|---|---|", *out, ""]


def _task_switch(run: Run) -> bool:
    return run.get("task.name") == "switch"


def _schedule(run: Run) -> list[tuple[str, int, int | None]]:
    """A run's segments (target, or task for a ``task=switch`` stream; first prompt, last prompt or
    None = to the end), from ``target_switch`` or ``task.switch_at`` (one segment for a run without
    a switch)."""
    if _task_switch(run):
        comps, at = [str(c) for c in run.get("task.components")[:2]], int(run.get("task.switch_at"))
        off = int(run.get("task.offset") or 0)
        return [(comps[0], off, at - 1), (comps[1], max(at, off), None)] if at > off else [(comps[1], off, None)]
    targets = [str(t) for t in (run.get("target_switch.targets") or [])] or [str(run.get("target.name"))]
    at = [int(a) for a in (run.get("target_switch.at") or [])]
    off = int(run.get("task.offset") or 0)
    starts = [off, *(off + a for a in at)]
    ends = [b - 1 for b in starts[1:]] + [None]
    return list(zip(targets, starts, ends))


def _rows_in(rows: list[dict[str, Any]], first: int, last: int | None) -> list[dict[str, Any]]:
    """The rows of prompts first..last (None: to the end)."""
    return [r for r in rows if r.get("prompt/index") is not None and first <= r["prompt/index"]
            and (last is None or r["prompt/index"] <= last)]


def _range_stats(rows: list[dict[str, Any]], first: int, last: int | None) -> dict[str, Any] | None:
    """Acceptance (95% bootstrap over the prompts) of the rows of prompts first..last; ``rows`` may
    pool several runs (seeds), the bootstrap then over prompts x seeds."""
    rs = _rows_in(rows, first, last)
    if not rs:
        return None
    idx = [r["prompt/index"] for r in rs]
    return cell_stats(Cell("", "", None, [], rs)) | {"first": min(idx), "last": max(idx)}


def _same_prompts(rows: list[dict[str, Any]], like: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`_range_stats` of the ``rows`` whose prompts (task and id) are among ``like``'s."""
    want = {(r.get("task"), r.get("prompt/id")) for r in like}
    rs = [r for r in rows if (r.get("task"), r.get("prompt/id")) in want]
    return _range_stats(rs, 0, None) if rs else None


def switch_segments(runs: list[Run]) -> list[dict[str, Any]]:
    """Each segment of every switching stream among ``runs`` beside the same prompts of a control,
    then each schedule's segments pooled over its finished seeds beside their pooled controls. A
    target switch's control is a stream that never switches (that target throughout, same row and
    seed; the same prompt indices). A task switch's is the stream that starts on the segment's task
    (the other order, same row and seed; matched by task and prompt id); a stream's first segment
    has none.

    Returns:
        Dicts with ``run`` (label: row and seed, or ``pooled`` and the seeds; the first target when
        streams start from several), ``pooled``, ``schedule`` ((row, segments): the stream's kind),
        ``segment`` (0-based), ``target``, ``first`` / ``last`` (the schedule's prompts; ``last``
        None: to the end), ``stats`` / ``control`` (:func:`_range_stats` or None; a control that did
        not finish carries its ``status``) and ``no_control`` (why there is none). Unfinished runs
        appear with the prompts they reached; a seed pools once.
    """
    def targets(r: Run) -> list[str]:
        return [t for t, _, _ in _schedule(r)]

    switching = [r for r in runs if len(set(targets(r))) > 1]
    if not switching:
        return []
    controls = {(r.row, r.seed, targets(r)[0]): r for r in runs if len(set(targets(r))) == 1}
    starts_on = {(r.row, r.seed, targets(r)[0]): r for r in switching if _task_switch(r)}  # task switches
    rows_of: dict[Path, list[dict[str, Any]]] = {}

    def rows(r: Run) -> list[dict[str, Any]]:
        if r.path not in rows_of:
            rows_of[r.path] = [x for x in read_rows(r.path) if x.get("phase", "train") == "train"]
        return rows_of[r.path]

    starts = {targets(r)[0] for r in switching}
    out: list[dict[str, Any]] = []

    def add(run: str, pooled: bool, j: int, tgt: str, first: int, last: int | None, st: dict | None,
            cs: dict | None, no_ctl: str, key: tuple) -> None:
        if st is not None or cs is not None:
            out.append({"run": run, "pooled": pooled, "segment": j, "target": tgt, "first": first, "last": last,
                        "stats": st, "control": cs, "no_control": no_ctl, "schedule": key})

    def control(r: Run, j: int, tgt: str) -> Run | None:
        if _task_switch(r):  # the other order's stream; a stream's first task has no control
            c = starts_on.get((r.row, r.seed, tgt))
            return None if j == 0 or c is r else c
        return controls.get((r.row, r.seed, tgt))

    def control_stats(ctl_rows: list[dict[str, Any]], own: list[dict[str, Any]], task: bool, first: int,
                      last: int | None) -> dict[str, Any] | None:
        return _same_prompts(ctl_rows, _rows_in(own, first, last)) if task else _range_stats(ctl_rows, first, last)

    pools: dict[tuple, list[Run]] = {}
    for r in switching:
        start = f" from {targets(r)[0]}" if len(starts) > 1 else ""
        key = (r.row, tuple(_schedule(r)))
        for j, (tgt, first, last) in enumerate(_schedule(r)):
            ctl = control(r, j, tgt)
            cs = control_stats(rows(ctl), rows(r), _task_switch(r), first, last) if ctl else None
            if cs is not None and ctl.status != "ok":
                cs = {**cs, "status": ctl.status}
            why = ("the stream starts on it" if _task_switch(r) and j == 0 else "no control run" if ctl is None
                   else f"the control ({ctl.status}) did not reach these prompts")
            add(f"{r.row} s{r.seed}{start}" + ("" if r.status == "ok" else f" ({r.status})"), False, j, tgt, first,
                last, _range_stats(rows(r), first, last), cs, why, key)
        if r.status == "ok" and all(x.seed != r.seed for x in pools.get(key, [])):  # a seed once
            pools.setdefault(key, []).append(r)
    for (row, schedule), rs in pools.items():
        if len(rs) < 2:
            continue
        key = (row, schedule)
        start = f" from {schedule[0][0]}" if len(starts) > 1 else ""
        task = _task_switch(rs[0])
        for j, (tgt, first, last) in enumerate(schedule):
            ctls = [control(r, j, tgt) for r in rs]
            ok_ctls = all(c is not None and c.status == "ok" for c in ctls)
            missing = ", ".join(f"s{r.seed}" for r, c in zip(rs, ctls) if c is None or c.status != "ok")
            own = [x for r in rs for x in rows(r)]
            add(f"{row} pooled s{','.join(str(r.seed) for r in sorted(rs, key=lambda r: r.seed))}{start}", True, j,
                tgt, first, last, _range_stats(own, first, last),
                control_stats([x for c in ctls for x in rows(c)], own, task, first, last) if ok_ctls else None,
                "the stream starts on it" if task and j == 0 else f"no finished control for {missing}", key)
    return out


def render_segments(runs: list[Run]) -> list[str]:
    """Markdown of :func:`switch_segments`: whether each target's acceptance is back at its own
    level (its control's on the same prompts) when it returns."""
    segs = switch_segments(runs)
    if not segs:
        return []
    task = any(_task_switch(r) for r in runs)
    if task:
        out = ["## Per task segment (task switch), beside the stream that starts on that task", "",
               "Acceptance per segment [95% bootstrap over its prompts]; control: the same prompts (task and id) "
               "decoded by the stream that starts on that task, the other order (same row and seed): a drafter "
               "fresh on the task, where the segment's drafter adapted to the other task first; separated: the two "
               "intervals do not overlap. "]
    else:
        out = ["## Per target segment (target_switch), beside a control stream that never switches", "",
               "Acceptance per segment [95% bootstrap over its prompts]; control: the same prompts decoded by a "
               "stream with that target throughout (same row and seed); separated: the two intervals do not overlap. "]
    out[-1] += ("Rows `pooled`: the same schedule's finished runs over their seeds, beside their controls (bootstrap "
                "over prompts x seeds).")
    out += ["", f"| run | segment | {'task' if task else 'target'} | prompts | acceptance | control (same prompts) "
            "| separated |", "|---|---|---|---|---|---|---|"]
    for g in segs:
        st, cs, first, last = g["stats"], g["control"], g["first"], g["last"]
        span = f"{st['first']}..{st['last']}" if st else f"{first}..{'' if last is None else last}"
        sep = separated(st, cs) if st and cs else None
        ours = _num(st["acc"]) + _ci(st["acc_ci"]) if st else "not reached"
        ctl_txt = (_num(cs["acc"]) + _ci(cs["acc_ci"]) + f" ({cs['first']}..{cs['last']}"
                   + (f"; control {cs['status']}" if cs.get("status") else "") + ")" if cs else g["no_control"])
        out.append(f"| {g['run']} | {g['segment'] + 1} | {g['target']} | {span} | {ours} | {ctl_txt} | "
                   f"{'–' if sep is None else ('yes' if sep else 'no')} |")
    out.append("")
    return out


def compare_orderings(ours: dict[str, dict[str, Any]], paper: dict[str, float]) -> dict[str, list[tuple[str, str]]]:
    """Row pairs of one column, ours against the paper, by acceptance.

    Args:
        ours: row -> cell stats (:func:`cell_stats`: ``acc``, ``acc_ci``).
        paper: row -> the paper's acceptance, for the rows it reports.

    Returns:
        Each pair (higher, lower) in the paper's order, under one verdict: ``agree`` (ours in the same
        order, the 95% intervals separate), ``agree_ci_overlap`` (same order, intervals overlap),
        ``reversed_ci_overlap`` (the other order or equal, intervals overlap), ``reversed`` (the
        other order, intervals separate); ``paper_tie`` for pairs the paper reports equal; ``no_ci``
        also lists the pairs where a cell has no interval (fewer than 2 test prompts), counted as
        overlapping.
    """
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in ("agree", "agree_ci_overlap", "reversed_ci_overlap",
                                                             "reversed", "paper_tie", "no_ci")}
    rows = [r for r in paper if r in ours and ours[r].get("acc") is not None]
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if paper[a] == paper[b]:
                out["paper_tie"].append((a, b))
                continue
            hi, lo = (a, b) if paper[a] > paper[b] else (b, a)
            same = ours[hi]["acc"] > ours[lo]["acc"]
            sep = separated(ours[hi], ours[lo])
            if sep is None:
                out["no_ci"].append((hi, lo))
            verdict = ("agree" if sep else "agree_ci_overlap") if same else ("reversed" if sep else "reversed_ci_overlap")
            out[verdict].append((hi, lo))
    return out


def _ranking(ours: dict[str, dict[str, Any]], label=lambda r: LABELS.get(r, r)) -> str:
    """Rows (or a one-row table's columns) best first by acceptance; ``>`` where the 95% intervals of
    neighbours separate, ``≈`` where they overlap, ``?`` where one has no interval."""
    order = sorted((r for r in ours if ours[r].get("acc") is not None), key=lambda r: -ours[r]["acc"])
    text = ""
    for i, r in enumerate(order):
        if i:
            sep = separated(ours[order[i - 1]], ours[r])
            text += " ? " if sep is None else " > " if sep else " ≈ "
        text += f"{label(r)} ({ours[r]['acc']:.3f})"
    return text


def ordering_groups(spec: dict[str, Any], stats: dict) -> list[dict[str, Any]]:
    """Every comparison of our ordering with the paper's: per target of ours, held value (a column, or
    for a one-row table such as Table 12 its row, whose columns are then ranked) and paper target
    with at least two items both report.

    Args:
        spec: the paper table (:func:`spec_of`).
        stats: (target, row, column) -> cell stats (:func:`cell_stats`), cells without stats left out.

    Returns:
        Dicts with ``target``, ``held``, ``paper_target``, ``by_col`` (columns ranked), ``ours`` (item
        -> stats), ``paper`` (item -> the paper's acceptance, shared items only) and ``verdicts``
        (:func:`compare_orderings`).
    """
    rows, cols, targets = _order(spec, stats)
    paper_targets = list(dict.fromkeys(c.get("target") for c in spec["cells"] if "acc" in c))
    by_col = len(spec.get("rows") or []) == 1

    def split(row: str, col: Any) -> tuple[str, str]:
        """A cell's (ranked item, held value)."""
        return (str(col), row) if by_col else (row, str(col))

    out = []
    for tgt in targets:
        for h in (rows if by_col else [str(c) for c in cols]):
            ours = {split(k[1], k[2])[0]: stats[k] for k in stats
                    if k[0] == tgt and split(k[1], k[2])[1] == h and stats.get(k)}
            if len(ours) < 2:
                continue
            for pt in paper_targets:
                paper = {split(x["row"], x["col"])[0]: float(x["acc"]) for x in spec["cells"]
                         if x.get("target") == pt and split(x["row"], x["col"])[1] == h and "acc" in x}
                paper = {r: v for r, v in paper.items() if r in ours}
                if len(paper) < 2:
                    continue
                out.append({"target": tgt, "held": h, "paper_target": pt, "by_col": by_col, "ours": ours,
                            "paper": paper, "verdicts": compare_orderings(ours, paper)})
    return out


def _item_label(spec: dict[str, Any], by_col: bool):
    """How a ranked item is named: a row by its label, a one-row table's column as ``<setting>=<value>``."""
    short = str(spec["cols"]).rsplit(".", 1)[-1]
    return (lambda item: f"{short}={item}") if by_col else (lambda item: LABELS.get(item, item))


def render_orderings(spec: dict[str, Any], cells: dict, stats: dict) -> list[str]:
    """Markdown: per target of ours and column, our rows best first and the paper's order of the same
    rows, with every pair's verdict (:func:`compare_orderings`), against each paper target. A table of
    one row (Table 12: the LoRA rank) ranks its columns instead, per row."""
    groups = ordering_groups(spec, {k: stats.get(k) for k in cells if stats.get(k)})
    if not groups:
        return []
    by_col = groups[0]["by_col"]
    ranked, held = ("column", "row") if by_col else ("row", "column")
    label = _item_label(spec, by_col)

    def names(pairs: list[tuple[str, str]], no_ci: list[tuple[str, str]] = ()) -> str:
        return "; ".join(f"{label(a)} > {label(b)}{' (no CI)' if (a, b) in no_ci else ''}"
                         for a, b in pairs) or "–"

    out = [f"## Ordering of the {ranked}s by acceptance, ours vs the paper", "",
           "Ours best first (`>`: the neighbours' 95% intervals separate; `≈`: they overlap; `?`: one has no interval). "
           f"Pairs are the {ranked}s both report, in the paper's order: agree (same order, intervals separate) / agree, "
           "CIs overlap / reversed, CIs overlap / reversed (intervals separate); (no CI): a cell without an interval; "
           "pairs the paper reports equal are listed with the paper's order.", "",
           f"| target | {held} | ours | paper (target) | agree | agree, CIs overlap | reversed, CIs overlap | reversed |",
           "|---|---|---|---|---|---|---|---|"]
    for g in groups:
        ours, paper, v = g["ours"], g["paper"], g["verdicts"]
        p_order = " > ".join(f"{label(r)} ({paper[r]:.3g})" for r in sorted(paper, key=lambda r: -paper[r]))
        ties = "".join(f"; tie: {label(a)} = {label(b)}" for a, b in v["paper_tie"])
        out.append(f"| {g['target']} | {LABELS.get(g['held'], g['held'])} | {_ranking(ours, label)} | {p_order} "
                   f"({TARGET_NAMES.get(g['paper_target'], g['paper_target'])}){ties} | {names(v['agree'])} | "
                   f"{names(v['agree_ci_overlap'], v['no_ci'])} | "
                   f"{names(v['reversed_ci_overlap'], v['no_ci'])} | {names(v['reversed'])} |")
    return out + [""]


def cells_runs(cells: dict) -> list[Run]:
    """Every run of the cells, in cell order."""
    return [r for c in cells.values() for r in c.runs]


def render_latex(name: str, spec: dict[str, Any], cells: dict, stats: dict) -> str:
    """The same table as a LaTeX ``tabular`` (booktabs)."""
    rows, cols, targets = _order(spec, cells)

    def esc(s: str) -> str:
        return str(s).replace("_", r"\_").replace("λ", r"$\lambda$").replace("%", r"\%")

    out = [f"% {spec['title']} -- generated by omnidraft tables (experiment paper/{name})",
           r"\begin{tabular}{llllll}", r"\toprule",
           r"target & row & " + esc(spec["cols"]) + r" & acceptance (ours) & speedup (ours) & paper \\", r"\midrule"]
    for tgt in targets:
        for r in rows:
            for c in cols:
                key = next((k for k in cells if k[0] == tgt and k[1] == r and str(k[2]) == str(c)), None)
                st = stats.get(key)
                if st is None:
                    continue
                acc = _num(st["acc"]) + (f" [{st['acc_ci'][0]:.3f}, {st['acc_ci'][1]:.3f}]" if st["acc_ci"] else "")
                sp = _num(st["speedup"], ".2f") + (f" [{st['speedup_ci'][0]:.2f}, {st['speedup_ci'][1]:.2f}]"
                                                   if st["speedup_ci"] else "")
                out.append(f"{esc(tgt)} & {esc(LABELS.get(r, r))} & {esc(c)} & {acc} & {sp} & "
                           f"{esc(_paper_cell(spec, r, c))} \\\\")
    out += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------ plots


def rolling(rows: list[dict[str, Any]], w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Acceptance and modelled speedup of each window of ``w`` consecutive rows (a cell's formulas,
    :func:`_stats`, over the window), at x = the window's last row (1-based); speedup None when the
    rows carry no timing."""
    v = _vectors(rows)

    def total(k: str) -> np.ndarray:
        return np.convolve(v[k], np.ones(w), "valid")

    x = np.arange(w, len(rows) + 1)
    acc = total("acc") / np.maximum(total("prop"), 1e-12)
    if "sd_s" not in v:
        return x, acc, None
    return x, acc, total("new") * total("ar_s") / np.maximum(total("sd_s") * total("ar_steps"), 1e-12)


def _short_names(names: list[str]) -> list[str]:
    """Each name cut to its fewest leading ``_``-parts that still tell it from the other names
    (``qwen25_coder_15b``, ``gemma3_270m`` -> ``qwen25``, ``gemma3``; ``qwen25_14b``, ``qwen25_7b`` kept)."""
    distinct = list(dict.fromkeys(names))

    def short(n: str) -> str:
        parts = n.split("_")
        for k in range(1, len(parts) + 1):
            head = "_".join(parts[:k])
            if not any(o != n and (o == head or o.startswith(head + "_")) for o in distinct):
                return head
        return n

    return [short(n) for n in names]


def plot_runs(name: str, runs: list[Run], out_dir: Path, spec: dict[str, Any] | None,
              stats: dict | None = None, speed_machine: str | None = None) -> list[Path]:
    """PNG plots of an experiment's runs: acceptance over the train stream with the test-set points
    (Figure 2), loss curves, n-gram cache growth, draft-length distribution, speedup by column; with
    ``speed_machine``, replays' speed over the stream modelled under that machine's calibrations, as
    the table's (:func:`remodel_speed`).

    Returns:
        The files written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency (pyproject)
        raise OmniDraftError(f"plots need matplotlib ({e}): pip install matplotlib") from e
    ok = [r for r in runs if r.status == "ok"]
    written: list[Path] = []

    def label(r: Run) -> str:
        col = col_value(r, spec["cols"]) if spec else None
        if isinstance(col, str) and " > " in col:  # a schedule of targets (col_value): their short names
            col = ">".join(_short_names(col.split(" > ")))
        return f"{r.row or r.summary.get('method')} {col if col is not None else ''} s{r.seed}".strip()

    def save(fig, stem: str) -> None:
        p = out_dir / f"{name}_{stem}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    every = {id(r): read_rows(r.path) for r in ok}
    trains = [(r, [x for x in every[id(r)] if x.get("phase", "train") == "train"]) for r in ok]
    trains = [(r, remodel_speed(r, t, speed_machine) if speed_machine else t) for r, t in trains if t]
    if trains:  # Figure 2: acceptance and modelled speedup over the train stream, test-set evaluations as points
        speed = any("sd_s" in _vectors(t) for _, t in trains)
        fig, axes = plt.subplots(2 if speed else 1, 1, figsize=(7, 6.4 if speed else 3.6), sharex=True, squeeze=False)
        ax, ax_sp = axes[0][0], (axes[1][0] if speed else None)
        for r, t in trains:
            x, acc, sp = rolling(t, max(1, min(20, len(t) // 5)))
            line, = ax.plot(x, acc, lw=1, label=label(r))
            # the run's test-set evaluations, from its rows (speed as the lines')
            evals = {at: remodel_speed(r, rs, speed_machine) if speed_machine else rs
                     for at, rs in sorted(_evals(every[id(r)]).items())}
            dyn = [(at, *_stats(_vectors(rs), np.arange(len(rs)))) for at, rs in evals.items()]
            if dyn:
                ax.plot([d[0] for d in dyn], [d[1] for d in dyn], "o", color=line.get_color(), ms=4)
            if ax_sp is not None and sp is not None:
                ax_sp.plot(x, sp, lw=1, color=line.get_color(), label=label(r))
                pts = [(d[0], d[2]) for d in dyn if not np.isnan(d[2])]
                if pts:
                    ax_sp.plot(*zip(*pts), "o", color=line.get_color(), ms=4)
        pooled = [(k, st) for k, st in (stats or {}).items() if (st or {}).get("evals") and len(st["seeds"]) >= 2]
        for i, ((_, row, col), st) in enumerate(pooled):  # each evaluation pooled over seeds, with its 95% CI
            evals, marker = st["evals"], "sDv^<>p*"[i % 8]  # black, one marker shape per cell
            lab = f"{row} {col if col is not None else ''} s{','.join(map(str, st['seeds']))} pooled (95% CI)"
            for a, key in ((ax, "acc"), (ax_sp, "speedup")):
                pts = [e for e in evals if e.get(key) is not None and e.get(f"{key}_ci")]
                if a is not None and pts:
                    a.errorbar([e["at"] for e in pts], [e[key] for e in pts], fmt=marker, color="k", ms=4, capsize=3,
                               yerr=[[e[key] - e[f"{key}_ci"][0] for e in pts], [e[f"{key}_ci"][1] - e[key] for e in pts]],
                               label=lab)
        ax.set_ylabel("acceptance rate")
        ax.set_title("acceptance over the train stream (line: rolling, points: test set)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        if ax_sp is not None:
            ax_sp.axhline(1.0, color="k", lw=0.5)
            ax_sp.set_ylabel("modelled speedup")
            ax_sp.set_title("modelled speedup over the train stream (line: rolling, points: test set)", fontsize=9)
        stream = all(r.summary.get("protocol") == "stream" for r, _ in trains)
        (ax_sp if ax_sp is not None else ax).set_xlabel("stream prompts" if stream else "train prompts")
        save(fig, "acceptance")
        losses = [(r, t) for r, t in trains if any("adapt/loss" in x or "head/loss" in x for x in t)]
        if losses:
            fig, ax = plt.subplots(figsize=(7, 3.6))
            for r, t in losses:
                for key, style in (("adapt/loss_dm", "-"), ("adapt/loss_ngram", "--"), ("head/loss", ":")):
                    pts = [(i, x[key]) for i, x in enumerate(t) if x.get(key) is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, lw=1, label=f"{label(r)} {key.split('/')[-1]}")
            ax.set_xlabel("train prompts"), ax.set_ylabel("loss"), ax.legend(fontsize=6, ncol=2)
            ax.set_title("L_DM (solid), L_Ngram (dashed), head BCE (dotted) at each update", fontsize=9)
            save(fig, "losses")
        grow = [(r, t) for r, t in trains if any(x.get("ngram/size") for x in t)]
        if grow:
            fig, ax = plt.subplots(figsize=(7, 3.6))
            for r, t in grow:
                ax.plot([x.get("ngram/size", 0) for x in t], lw=1, label=label(r))
            ax.set_xlabel("train prompts"), ax.set_ylabel("n-gram cache entries"), ax.legend(fontsize=6, ncol=2)
            save(fig, "ngram_cache")
    segs = switch_segments(runs)
    if segs:  # a target or task switch: each segment beside its control on the same prompts
        pooled = {g["schedule"] for g in segs if g["pooled"]}  # seeds pooled where a schedule has several
        shown = [g for g in segs if g["pooled"] or g["schedule"] not in pooled]
        labels = list(dict.fromkeys(g["run"] for g in shown))
        fig, axes = plt.subplots(len(labels), 1, figsize=(7, 2.4 * len(labels) + 0.6), squeeze=False, sharey=True)
        colors = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(g["target"] for g in shown))}
        for ax, lab in zip(axes[:, 0], labels):
            ticks = [g for g in shown if g["run"] == lab]
            for g in ticks:
                for key, dx, face in (("stats", -0.08, None), ("control", 0.08, "none")):
                    st = g[key]
                    if st is None or st.get("acc") is None:
                        continue
                    x = g["segment"] + 1 + dx
                    err = ([[st["acc"] - st["acc_ci"][0]], [st["acc_ci"][1] - st["acc"]]] if st.get("acc_ci") else None)
                    ax.errorbar([x], [st["acc"]], yerr=err, fmt="o", color=colors[g["target"]], mfc=face, ms=5,
                                capsize=2, lw=1)
            ax.set_xticks([g["segment"] + 1 for g in ticks],
                          [f"{g['target']}\n{g['first']}..{'' if g['last'] is None else g['last']}" for g in ticks],
                          fontsize=6)
            whose = "the other order's stream" if any(_task_switch(r) for r in runs) else "its target's control"
            ax.set_title(f"{lab}: filled = the switching stream, hollow = {whose} (same prompts)", fontsize=8)
            ax.set_ylabel("acceptance", fontsize=8)
        save(fig, "segments")
    lens = [(r, [n for x in test_rows(r) for n in (x.get("sd/step_proposed") or [])]) for r in ok]
    lens = [(r, v) for r, v in lens if v]
    if lens:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        top = max(max(v) for _, v in lens)
        for r, v in lens[:12]:
            ax.hist(v, bins=np.arange(0.5, top + 1.5), histtype="step", density=True, label=label(r))
        ax.set_xlabel("target tokens proposed per step (test set)"), ax.set_ylabel("share of steps")
        ax.legend(fontsize=6, ncol=2)
        save(fig, "draft_length")
    if stats and spec:
        keys = [k for k, s in stats.items() if s.get("speedup") is not None]
        if keys:
            fig, ax = plt.subplots(figsize=(7, 3.6))
            cols = sorted({str(k[2]) for k in keys})
            rows_ = list(dict.fromkeys(k[1] for k in sorted(keys, key=lambda k: (spec.get("rows") or []).index(k[1])
                                                            if k[1] in (spec.get("rows") or []) else 99)))
            width = 0.8 / max(1, len(rows_))
            for j, rw in enumerate(rows_):
                xs, ys, err = [], [], []
                for i, c in enumerate(cols):
                    k = next((k for k in keys if k[1] == rw and str(k[2]) == c), None)
                    if k is None:
                        continue
                    s = stats[k]
                    xs.append(i + j * width)
                    ys.append(s["speedup"])
                    lo, hi = s["speedup_ci"] or (s["speedup"], s["speedup"])
                    err.append((s["speedup"] - lo, hi - s["speedup"]))
                ax.bar(xs, ys, width, yerr=np.array(err).T if err else None, label=LABELS.get(rw, rw), capsize=2)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cols))], cols, fontsize=7)
            ax.axhline(1.0, color="k", lw=0.5)
            ax.set_ylabel("modelled speedup (test set)"), ax.legend(fontsize=6, ncol=2)
            save(fig, "speedup")
    return written


# ------------------------------------------------------------------------------ entry point


def _provenance(runs: list[Run]) -> dict[str, Any]:
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        return {}
    from omnidraft.tables import cpu

    def one(vals: list[Any]) -> str:
        vals = sorted({str(v) for v in vals if v is not None})
        return ", ".join(vals) if vals else "?"

    return {"cpu": one(f"{(r.summary.get('provenance') or {}).get('cpu')} ({cpu(r.summary)})" for r in ok), "engine": one(r.summary.get("engine") for r in ok),
            "dtype": one(r.get("target.dtype") for r in ok), "max_new_tokens": one(r.summary.get("max_new_tokens") for r in ok),
            "train": one(r.summary.get("n_train_prompts") for r in ok if r.summary.get("protocol") != "stream"),
            "test": one(r.summary.get("n_test") for r in ok if r.summary.get("protocol") != "stream"),
            "stream": one(r.summary.get("n_prompts") for r in ok if r.summary.get("protocol") == "stream")}


def _only_stream(provenance: dict[str, Any]) -> bool:
    return provenance.get("stream", "?") != "?" and provenance.get("test", "?") == "?"


def _cells_over(provenance: dict[str, Any]) -> str:
    if _only_stream(provenance):
        return "the stream's prompts as it goes (protocol=stream, adapting online)"
    return "the test prompts after training"


def _boot_over(provenance: dict[str, Any]) -> str:
    return "the stream's prompts" if _only_stream(provenance) else "the test prompts"


def _prompts_line(provenance: dict[str, Any]) -> str:
    """How many prompts the runs decoded: train and test prompts (``protocol=train_test``), the stream's
    prompts (``protocol=stream``), or both where a table mixes them."""
    parts = []
    if provenance.get("train", "?") != "?" or provenance.get("test", "?") != "?":
        parts.append(f"train prompts {provenance.get('train', '?')}, test prompts {provenance.get('test', '?')}")
    if provenance.get("stream", "?") != "?":
        parts.append(f"stream prompts {provenance['stream']} (protocol=stream: acceptance as the stream goes)")
    return "; ".join(parts) or "train prompts ?, test prompts ?"


def sweep_dir(run_dir: Path, root: Path) -> Path:
    """The sweep directory a run belongs to: its nearest parent up to ``root`` that holds Hydra's
    ``multirun.yaml``, else ``root`` (``root`` itself when it is the run's directory)."""
    if run_dir == root:
        return root
    for d in run_dir.parents:
        if (d / "multirun.yaml").is_file():
            return d
        if d == root:
            break
    return root


def write_paper_tables(root: Path, plots: bool = True, speed_machine: str | None = None) -> list[Path]:
    """Every paper experiment's table (Markdown, LaTeX, JSON of the cells) and plots for the runs
    under ``root``, one set per experiment and sweep directory (:func:`sweep_dir`: a results
    directory's sweeps each get their own, never one table mixing scales), written into that sweep
    directory; with ``speed_machine``, replays' speedups modelled under that machine's calibrations
    (:func:`remodel_speed`). An ``overview.md`` in ``root`` or one or two directories up
    (:func:`write_overview`) is written again.

    Raises:
        OmniDraftError: ``root`` is not a directory, or holds no run of a paper experiment.
    """
    if not root.is_dir():
        raise OmniDraftError(f"{root}: not a directory; pass a sweep directory (results/paper/<table>/<scale>) "
                             "or a results directory")
    runs = read_runs(root)
    by_exp: dict[tuple[str, Path], list[Run]] = {}  # (experiment, its sweep directory): one table each
    for r in runs:
        exp = r.experiment or ""
        if exp.startswith("paper/"):
            by_exp.setdefault((exp.split("/", 1)[1], sweep_dir(r.path, root)), []).append(r)
    if not by_exp:
        if runs:  # another sweep: one line per run
            return write_sweep_table(root, runs)
        raise OmniDraftError(f"{root}: no run of a paper experiment (experiment=paper/<table>) under it; "
                             "run `omnidraft -m experiment=paper/table1 scale=cpu` first")
    written: list[Path] = []
    for (name, out), rs in sorted(by_exp.items()):
        spec = spec_of(name)
        cells = cells_of(rs, spec, speed_machine)
        stats = {k: cell_stats(c) for k, c in cells.items()}
        failed = [r for r in rs if r.status != "ok"]
        prov = _provenance(rs)
        if speed_machine:
            prov["speed_machine"] = speed_machine
        md = out / f"{name}.md"
        md.write_text(render_markdown(name, spec, cells, stats, failed, prov, rs), encoding="utf-8")
        tex = out / f"{name}.tex"
        tex.write_text(render_latex(name, spec, cells, stats), encoding="utf-8")
        js = out / f"{name}.json"
        js.write_text(json.dumps({"experiment": f"paper/{name}", "provenance": prov,
                                  "cells": [{"target": k[0], "row": k[1], "col": k[2], **v} for k, v in stats.items()],
                                  "failed": [{"run": str(f.path), "status": f.status, "error": f.error} for f in failed]},
                                 indent=1, default=str), encoding="utf-8")
        written += [md, tex, js]
        if plots:
            written += plot_runs(name, rs, out, spec, stats, speed_machine)
    for up in (root, root.parent, root.parent.parent):  # results/paper/<table>/<scale>: keep results/paper's overview true
        if (up / OVERVIEW).is_file():
            written.append(write_overview(up))
            break
    return written


OVERVIEW = "overview.md"


def _experiment_key(name: str) -> tuple:
    """Paper order: tables by number (table6 before table6_t1), then the figures and the rest."""
    digits = "".join(ch for ch in name.removeprefix("table").split("_")[0] if ch.isdigit())
    return (0, int(digits), name) if name.startswith("table") and digits else (1, 0, name)


REASONS = "reasons.yaml"


def read_reasons(path: Path) -> list[dict[str, Any]]:
    """The hand-written reasons why a pair of our rows is in the other order than the paper's
    (``results/paper/reasons.yaml``): a list under ``reasons:`` of entries with ``experiment``
    (``table1``), ``pair`` (the paper's order, higher first: row names, or a one-row table's column
    values), ``reason``, and optionally ``held`` (the column; a one-row table's row) and
    ``paper_target``. No file: no reasons.

    Raises:
        OmniDraftError: the file is not YAML, or an entry lacks a key or has one it does not know.
    """
    if not path.is_file():
        return []
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise OmniDraftError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    entries = data.get("reasons") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise OmniDraftError(f"{path}: needs a list under `reasons:`; see the comment at its top")
    keys = {"experiment", "pair", "reason", "held", "paper_target"}
    for i, e in enumerate(entries, 1):
        ok = (isinstance(e, dict) and not set(e) - keys and isinstance(e.get("experiment"), str)
              and isinstance(e.get("pair"), list) and len(e["pair"]) == 2 and str(e.get("reason") or "").strip())
        if not ok:
            raise OmniDraftError(f"{path}: entry {i} ({e!r:.80}) needs experiment, pair [higher, lower] and reason, "
                                 f"optionally held and paper_target, and no other key")
    return entries


def _reason_for(reasons: list[dict[str, Any]], name: str, group: dict[str, Any], hi: str, lo: str) -> dict | None:
    """The most specific entry of ``reasons`` for the pair (``hi`` above ``lo`` in the paper) of one
    ordering group (:func:`ordering_groups`) of experiment ``name``."""
    best, best_n = None, -1
    for e in reasons:
        if e["experiment"] != name or [str(x) for x in e["pair"]] != [hi, lo]:
            continue
        if "held" in e and str(e["held"]) != str(group["held"]):
            continue
        if "paper_target" in e and e["paper_target"] != group["paper_target"]:
            continue
        n = ("held" in e) + ("paper_target" in e)
        if n > best_n:
            best, best_n = e, n
    return best


def render_overview(root: Path, seeds: int = 3) -> str:
    """Every paper table under ``root`` at a glance, from the JSON files ``omnidraft tables <sweep
    dir>`` writes (``<dir>/<experiment>.json``): its cells, how many of the cells that train have
    ``seeds`` seeds, and its row pairs against the paper's by verdict (:func:`ordering_groups`); the
    core-hours the plans (``<root>/plans/<table>_<scale>.json``) leave and their finished jobs spent;
    then each reversed pair (intervals separated, then overlapping) with its reason from
    ``<root>/reasons.yaml`` (:func:`read_reasons`) or a note that it has none, and the reasons that
    match no reversed pair any more.

    Raises:
        OmniDraftError: ``root`` holds no paper table's JSON file; ``reasons.yaml`` is malformed.
    """
    found = []
    for f in sorted(root.rglob("*.json")):
        if "state" in f.parts or f.name in ("summary.json", "provenance.json", "meta.json"):
            continue
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and str(d.get("experiment", "")) == f"paper/{f.stem}" and isinstance(d.get("cells"), list):
            found.append((f, d))
    if not found:
        raise OmniDraftError(f"{root}: no paper table's JSON file under it (<table>/<scale>/<table>.json); "
                             "write them first with `omnidraft tables results/paper/<table>/<scale>`")
    found.sort(key=lambda fd: (_experiment_key(fd[0].stem), str(fd[0])))
    verdicts = ("agree", "agree_ci_overlap", "reversed_ci_overlap", "reversed")
    out = ["# The paper's tables at a glance", "",
           "Generated by `omnidraft tables <this directory> --overview` from each table's JSON file (written by "
           "`omnidraft tables <sweep dir>`, so regenerate those first). Pairs: the rows (Table 12: the LoRA ranks) "
           "that ours and the paper both report, per column and paper target, by acceptance: agree (same order, "
           "our 95% intervals separate) / agree, CIs overlap / reversed, CIs overlap / reversed (intervals "
           f"separate). Trained cells need {seeds} seeds; frozen greedy cells are seed-independent and run once.", "",
           "| experiment | table | cells | trained cells at "
           f"{seeds} seeds | seeds per trained cell | pairs: agree / agree, overlap / reversed, overlap / reversed | "
           "failed runs | left by its plan |",
           "|---|---|---:|---:|---|---|---:|---|"]
    reasons = read_reasons(root / REASONS)
    all_full = all_trained = 0
    used: set[int] = set()
    n_why = 0
    reversed_lines: dict[str, list[str]] = {"reversed": [], "reversed_ci_overlap": []}
    left: dict[str, dict[str, float]] = {}  # scale -> job name -> core-seconds (a cell two tables share, once)
    spent: dict[str, dict[str, float]] = {}  # the same for finished jobs, as measured (a copied cell costs 0)
    for f, d in found:
        name = f.stem
        plan_file = root / "plans" / f"{name}_{f.parent.name}.json"
        try:
            plan = json.loads(plan_file.read_text(encoding="utf-8")) if plan_file.is_file() else None
        except (OSError, ValueError):
            raise OmniDraftError(f"{plan_file}: not a readable plan; write it again with `omnidraft plan "
                                 f"experiment=paper/{name} scale={f.parent.name} seed=0,1,2 --out={plan_file.with_suffix('.md')}`") from None
        if plan:
            todo = [j for j in plan["jobs"] if j["status"] in ("to run", "partial", "failed")]
            left.setdefault(f.parent.name, {}).update({j["name"]: j["core_s"] or 0.0 for j in todo})
            done = spent.setdefault(f.parent.name, {})
            for j in plan["jobs"]:
                if j["status"] == "done":
                    done[j["name"]] = max(done.get(j["name"], 0.0), j["core_s"] or 0.0)
            plan_text = f"~{plan['totals']['left_core_hours']:.1f} core-h, {len(todo)} jobs"
        else:
            plan_text = "no plan"
        spec = spec_of(name)
        stats = {(c["target"], c["row"], c["col"]): {**c, "acc_ci": tuple(c["acc_ci"]) if c.get("acc_ci") else None}
                 for c in d["cells"]}
        trained = [c for c in d["cells"] if not c.get("seed_independent")]
        n_seeds = sorted({len(c.get("seeds") or []) for c in trained})
        count = {v: 0 for v in verdicts}
        for g in ordering_groups(spec, stats):
            for v in verdicts:
                count[v] += len(g["verdicts"][v])
            label = _item_label(spec, g["by_col"])
            for verdict, lines in reversed_lines.items():
                for hi, lo in g["verdicts"][verdict]:
                    where = f"{LABELS.get(g['held'], g['held'])}, {TARGET_NAMES.get(g['paper_target'], g['paper_target'])}"
                    why = _reason_for(reasons, name, g, hi, lo)
                    if why is not None:
                        used.add(id(why))
                        n_why += 1
                    lines.append(
                        f"- {name} ({f.parent.name}), {g['target']}, {where}: ours {label(lo)} "
                        f"{g['ours'][lo]['acc']:.3f}{_ci(g['ours'][lo].get('acc_ci'))} "
                        f"{'above' if g['ours'][lo]['acc'] > g['ours'][hi]['acc'] else 'level with'} {label(hi)} "
                        f"{g['ours'][hi]['acc']:.3f}{_ci(g['ours'][hi].get('acc_ci'))}; the paper {label(hi)} "
                        f"{g['paper'][hi]:.3g} above {label(lo)} {g['paper'][lo]:.3g}. "
                        + (f"Why: {' '.join(str(why['reason']).split())}" if why else
                           f"**No reason recorded** (add one to {REASONS})."))
        pairs = (" / ".join(str(count[v]) for v in verdicts) if any(count.values())
                 else "– (no pair both report)" if any("acc" in c for c in spec["cells"]) else "– (no paper numbers)")
        full = sum(len(c.get("seeds") or []) >= seeds for c in trained)
        all_full, all_trained = all_full + full, all_trained + len(trained)
        spread = "–" if not n_seeds else (f"{n_seeds[0]}" if len(n_seeds) == 1 else f"{n_seeds[0]}-{n_seeds[-1]}")
        link = f.relative_to(root).with_suffix(".md").as_posix()
        out.append(f"| {name} ({f.parent.name}) | [{link}]({link}) | {len(d['cells'])} | {full}/{len(trained)} | "
                   f"{spread} | {pairs} | {len(d.get('failed') or [])} | {plan_text} |")
    out += ["", f"Trained cells at {seeds} seeds, all tables: {all_full} of {all_trained} (a cell two tables share "
            "counted in each)."]
    if left:
        out += ["", "Left by the plans (`omnidraft plan experiment=paper/<table> scale=<scale> seed=0,1,2 "
                "--out=<this dir>/plans/<table>_<scale>.md`, as last written; a job two tables share counted once): "
                + "; ".join(f"{sc}: ~{sum(v.values()) / 3600:.1f} core-hours, {len(v)} jobs" for sc, v in sorted(left.items()))
                + "."]
        cost = {sc: (sum(spent[sc].values()) / 3600, len(spent[sc]), sum(v.values()) / 3600) for sc, v in left.items()}
        out += ["", "Spent by the finished jobs, as their rows measured them on the machines that ran them (one "
                "thread each; a copied cell costs nothing; the target traces the replays read are not counted), "
                "and the whole set with what is left: "
                + "; ".join(f"{sc}: ~{h:.1f} core-hours spent in {n} jobs, ~{h + h_left:.1f} in all"
                            for sc, (h, n, h_left) in sorted(cost.items()))
                + "."]
    n_rev = sum(len(v) for v in reversed_lines.values())
    out += ["", f"Reversed pairs: {n_rev}, {n_why} with a reason (hand-written in `{REASONS}` beside this file: "
            "the experiment, the paper's pair higher first, optionally the column and paper target).",
            "", "## Reversed with separated intervals", ""]
    out += reversed_lines["reversed"] or ["None."]
    out += ["", "## Reversed with overlapping intervals", ""]
    out += reversed_lines["reversed_ci_overlap"] or ["None."]
    stale = [e for e in reasons if id(e) not in used]
    if stale:
        out += ["", f"## Reasons in {REASONS} that match no reversed pair now", "",
                "The order agrees with the paper's now, or the cell is gone: keep the entry for the record or delete it.", ""]
        out += [f"- {e['experiment']}: {e['pair'][0]} > {e['pair'][1]}"
                + "".join(f", {k} {e[k]}" for k in ("held", "paper_target") if k in e) for e in stale]
    return "\n".join(out) + "\n"


def write_overview(root: Path, seeds: int = 3) -> Path:
    """``<root>/overview.md`` (:func:`render_overview`)."""
    if not root.is_dir():
        raise OmniDraftError(f"{root}: not a directory; pass the directory that holds the paper tables (results/paper)")
    path = root / OVERVIEW
    path.write_text(render_overview(root, seeds), encoding="utf-8")
    return path


def _overrides(run: Run) -> list[str]:
    """The command-line overrides a run was launched with (its provenance records them)."""
    prov = run.path / "provenance.json"
    if not prov.is_file():
        return []
    return [str(o) for o in (json.loads(prov.read_text(encoding="utf-8")).get("overrides") or [])]


def write_sweep_table(root: Path, runs: list[Run]) -> list[Path]:
    """``<root>/sweep.md``: one line per run of a sweep that is not a paper experiment, labelled by the
    overrides its runs do not share, with its (test) prompts' acceptance, tokens per step and
    modelled speedup (95% bootstrap intervals over prompts), and the share of steps prompt lookup
    proposed. The overrides all runs share head the file."""
    over = {r.path: _overrides(r) for r in runs}
    common = set.intersection(*(set(o) for o in over.values())) if over else set()
    lines = [f"# Sweep: {root.name}", "", "Shared overrides: " + (" ".join(o for o in next(iter(over.values()))
                                                                  if o in common) or "none") + ".", "",
             "| run | overrides | status | n | acceptance [95% CI] | tokens/step | modelled speedup [95% CI] "
             "| lookup steps |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = test_rows(r) if r.status == "ok" else []
        st = cell_stats(Cell(str(r.get("target.name")), str(r.row), None, [r], rows)) if rows else {}
        s = summarise(rows, greedy=True) if rows else {}

        def ci(v, c, f=".3f"):
            return "-" if v is None else f"{v:{f}}" + (f" [{c[0]:{f}}, {c[1]:{f}}]" if c else "")

        lines.append(f"| {r.path.relative_to(root)} | {' '.join(o for o in over[r.path] if o not in common)} | "
                     f"{r.status} | {st.get('n', 0)} | {ci(st.get('acc'), st.get('acc_ci'))} | "
                     f"{ci(st.get('mean_len'), None, '.2f')} | {ci(st.get('speedup'), st.get('speedup_ci'))} | "
                     f"{ci(s.get('draft/lookup_step_share'), None, '.2f')} |")
    lines += ["", "Tokens/step: new target tokens per verification step. Modelled speedup: engine=replay's, "
              "from the machine's latency calibration (the runs' provenance names it)."]
    out = root / "sweep.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [out]
