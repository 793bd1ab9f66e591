"""What a sweep still has to run, and what it costs, from the committed result files.

``omnidraft plan <sweep overrides>`` (e.g. ``omnidraft plan experiment=paper/table1 scale=cpu
seed=0,1,2``) lists every job of the sweep the way ``omnidraft -m`` would run it, with its state in
the results directory: ``done`` (its ``summary.json`` says ok), ``seed 0 stands`` (a seed-independent
cell: the sweep runs seed 0 only), ``shared`` (another table's finished run is the same cell: the
sweep copies it), ``partial`` (rows logged, unfinished: it resumes only where its git-ignored
``state/`` is, else starts over), ``failed`` (``error.txt``) and ``to run``. Each job still to run is
costed as the mean of finished runs alike (:func:`estimate`), in one-thread core-seconds summed from
their rows; the totals are the sweep's cost in core-hours. A new machine continues a sweep by running the same ``-m``
command: finished jobs are skipped.

The decode core does not import this module; the CLI composes the jobs and passes plain data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnidraft.tables import read_rows


@dataclass
class Cost:
    """A finished run's one-thread core-seconds by part: ``fixed`` (model loading, DistillSpec's
    offline distillation), ``stream`` (the prompts it decodes and learns on, their updates and ar
    baselines) and ``per_eval`` (one frozen evaluation of the test prompts under
    ``protocol=train_test``), of which it ran ``evals``."""

    fixed: float = 0.0
    stream: float = 0.0
    per_eval: float = 0.0
    evals: int = 0
    n_stream: int = 0  # prompts of its stream
    n_test: int = 0  # prompts of one evaluation

    def total(self, evals: int | None = None, stream_prompts: int | None = None,
              test_prompts: int | None = None) -> float:
        """Its cost with ``evals`` evaluations (None: as many as it ran), each part scaled to
        ``stream_prompts`` and ``test_prompts`` where given (per prompt as measured here)."""
        stream, per_eval = self.stream, self.per_eval
        if stream_prompts is not None and self.n_stream:
            stream = stream / self.n_stream * stream_prompts
        if test_prompts is not None and self.n_test:
            per_eval = per_eval / self.n_test * test_prompts
        return self.fixed + stream + per_eval * (self.evals if evals is None else evals)


@dataclass
class Job:
    """One job of a sweep: its overrides, run directory and what the results directory says of it."""

    overrides: list[str]
    run_dir: Path  # <sweep dir>/<name>
    name: str  # Hydra's override_dirname (may hold '/': a path in a value)
    row: str | None
    task: str | None
    trains: bool  # False: a frozen cell (seed-independent)
    target: str | None = None
    status: str = "to run"
    seconds: float | None = None  # measured (finished or partial) or estimated core-seconds
    estimated_from: str = ""  # set when ``seconds`` is an estimate: which runs it averages
    note: str = ""
    evals: int | None = None  # the test evaluations its config runs (None: as many as the runs it is costed from)
    cost: Cost | None = None  # measured, for a finished run
    engine: str | None = None  # live or replay
    stream_prompts: int | None = None  # prompts its stream decodes (train_test: the train prompts, 0 if frozen)
    test_prompts: int | None = None  # prompts of one test evaluation (train_test only)


def override_dirname(job: list[str], exclude: list[str], kv_sep: str = "=", item_sep: str = ",") -> str:
    """Hydra's ``${hydra:job.override_dirname}`` of a job's overrides: the task's overrides (Hydra's own,
    ``hydra.*`` and ``hydra/*``, are not among them) whose key is not excluded, sorted, joined."""
    lines = []
    for o in job:
        key, _, value = o.partition("=")
        if key.lstrip("+~") in exclude or key.lstrip("+~").startswith(("hydra.", "hydra/")):
            continue
        lines.append(f"{key}{kv_sep}{value}")
    return item_sep.join(sorted(lines))


def run_cost(run_dir: Path) -> tuple[Cost, int]:
    """One-thread core-seconds a run's rows account for (decoding, drafting, online updates, the ar
    baseline where a row ran it), by part (:class:`Cost`), and how many rows it logged."""
    rows = read_rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    cost = Cost()
    test = 0.0
    tested, streamed = set(), set()  # (evaluation point, prompt) and (phase, prompt): a prompt's turns are one
    for r in rows:
        t = float(r.get("sd/wall_s") or 0.0) + float(r.get("adapt/update_s") or 0.0) + float(r.get("ar/wall_s") or 0.0)
        if r.get("phase") == "test":
            test += t
            tested.add((r.get("eval/at"), r.get("prompt/index")))
        else:
            cost.stream += t
            streamed.add((r.get("phase"), r.get("prompt/index")))
    points = {at for at, _ in tested}
    cost.evals = len(points)
    cost.per_eval = test / len(points) if points else 0.0
    cost.n_test = round(len(tested) / len(points)) if points else 0
    cost.n_stream = len(streamed)
    summary = summary_of(run_dir)
    distill = summary.get("train/distill") or {}  # DistillSpec under train_test: its offline distillation
    cost.fixed = float(summary.get("time/load_s") or 0.0) + float(distill.get("distill/data_s") or 0.0) \
        + float(distill.get("distill/train_s") or 0.0)
    return cost, len(rows)


def run_seconds(run_dir: Path) -> tuple[float, int]:
    """A run's one-thread core-seconds in all (:func:`run_cost`) and how many rows it logged."""
    cost, n = run_cost(run_dir)
    return cost.total(), n


def summary_of(run_dir: Path) -> dict[str, Any]:
    """A run's ``summary.json``, {} when it is missing or unreadable (a run cut while writing it)."""
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def classify(job: Job, seed_stands: bool, shared_from: str | None) -> Job:
    """Set a job's status and, where it ran, its measured seconds."""
    summary = summary_of(job.run_dir)
    if summary.get("status") == "ok":
        job.status = "done"
        job.cost = run_cost(job.run_dir)[0]
        job.seconds = job.cost.total()
        if summary.get("shared_from"):
            job.note = f"copied from {summary['shared_from']}"
            job.seconds = 0.0
    elif seed_stands:
        job.status, job.seconds, job.note = "seed 0 stands", 0.0, "seed-independent: the sweep runs seed 0 only"
    elif shared_from:
        job.status, job.seconds, job.note = "shared", 0.0, f"the same cell finished in {shared_from}"
    elif (job.run_dir / "error.txt").is_file():
        job.status = "failed"
        job.note = (job.run_dir / "error.txt").read_text(encoding="utf-8").splitlines()[0][:120]
    elif (job.run_dir / "metrics.jsonl").is_file():
        spent, n = run_seconds(job.run_dir)
        job.status = "partial"
        job.note = (f"{n} rows logged ({spent / 60:.0f} min); resumes where its state/ is "
                    f"({'here' if (job.run_dir / 'state' / 'meta.json').is_file() else 'not on this machine: starts over'})")
    return job


def finished_runs(paper_dir: Path, scale: str) -> list[Job]:
    """Every finished run of every paper experiment at ``scale`` (``<paper_dir>/<table>/<scale>/*``),
    as costed jobs: what a sweep with no finished run of its own is estimated from."""
    out = []
    for f in sorted(Path(paper_dir).glob(f"*/{scale}/*/summary.json")):
        s = summary_of(f.parent)
        if s.get("status") != "ok" or s.get("shared_from"):
            continue
        ch = s.get("choices") or {}
        cost = run_cost(f.parent)[0]
        out.append(Job([], f.parent, f.parent.name, ch.get("row"), ch.get("task") or s.get("task"),
                       "train/skipped" not in s, ch.get("target") or s.get("target"), status="done",
                       seconds=cost.total(), cost=cost, engine=s.get("engine")))
    return out


def estimate(jobs: list[Job], others: list[Job] = ()) -> None:
    """Cost each job still to run (and each partial or failed one, as a whole run) from the finished
    runs: the mean of those with the same row, task and target, else the same row and task, else the
    same row, else those that train (or are frozen) alike; at each step the sweep's own runs first,
    then ``others`` (:func:`finished_runs`: other tables' at the same scale). A ``protocol=train_test``
    job is costed from runs that evaluated a test set (until the last tier), and each counts with the
    job's own number of test evaluations (Figure 2 evaluates five times, a table cell once). Runs
    are taken from the same engine (a live run verifies every step with the target and a replay does
    not) but in the last tier, which says so when it mixes them in; a run with no stream (frozen) never
    costs a job that has one; and their parts are scaled to the job's own numbers of stream and test
    prompts (a multi-turn prompt's turns count once)."""
    own = [j for j in jobs if j.status == "done" and j.cost and j.seconds and not j.note.startswith("copied")]
    rest = [o for o in others if o.cost and o.seconds and all(o.run_dir.resolve() != j.run_dir.resolve() for j in own)]

    def engine(x: Job) -> str:
        return x.engine or "live"

    def usable(d: Job, j: Job) -> bool:  # a run with no stream says nothing of a job's stream
        return d.trains == j.trains and not (j.stream_prompts and not d.cost.n_stream)

    def like(d: Job, j: Job) -> bool:  # train_test runs (test evaluations) are costed from their like, on one engine
        return (d.cost.evals > 0) == (j.evals is not None) and engine(d) == engine(j) and usable(d, j)

    tiers = (("same row, task and target",
              lambda d, j: d.row == j.row and d.task == j.task and d.target == j.target and like(d, j)),
             ("same row and task", lambda d, j: d.row == j.row and d.task == j.task and like(d, j)),
             ("same row", lambda d, j: d.row == j.row and like(d, j)),
             ("alike", like),
             ("alike, another protocol", lambda d, j: engine(d) == engine(j) and usable(d, j)),
             ("alike, any engine", usable))
    for j in jobs:
        if j.status not in ("to run", "partial", "failed"):
            continue
        for (why, alike), (pool, whose) in ((t, p) for t in tiers for p in ((own, "this sweep's"), (rest, "other tables'"))):
            hits = [d for d in pool if alike(d, j)]
            if hits:
                kind = why.replace("alike", "that train" if j.trains else "frozen", 1)
                others = sorted({engine(d) for d in hits} - {engine(j)})
                if others:  # a live job from replays (the target's verification missing), or the reverse
                    kind += f", some {'/'.join(others)}: this job runs {engine(j)}, so the estimate is rough"
                j.seconds = sum(d.cost.total(j.evals, j.stream_prompts, j.test_prompts) for d in hits) / len(hits)
                j.estimated_from = f"{len(hits)} of {whose} runs, {kind}"
                break


def totals(jobs: list[Job]) -> dict[str, Any]:
    """The plan's totals: jobs by status, core-hours measured (done) and estimated (left), and how many
    jobs left have no finished run alike to cost them from."""
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    left = [j for j in jobs if j.status in ("to run", "partial", "failed")]
    return {"jobs": len(jobs), "by_status": counts,
            "done_core_hours": sum(j.seconds or 0.0 for j in jobs if j.status == "done") / 3600,
            "left_jobs": len(left), "left_core_hours": sum(j.seconds or 0.0 for j in left) / 3600,
            "left_uncosted": sum(1 for j in left if j.seconds is None)}


def to_json(jobs: list[Job], command: str) -> dict[str, Any]:
    """The plan as data (written beside the Markdown): the command, each job's status and core-seconds
    (``estimated``: from finished runs alike), and :func:`totals`."""
    return {"command": command, "totals": totals(jobs),
            "jobs": [{"name": j.name, "status": j.status, "core_s": j.seconds, "estimated": bool(j.estimated_from),
                      "row": j.row, "task": j.task, "trains": j.trains, "overrides": list(j.overrides)} for j in jobs]}


def left_in_order(jobs: list[Job]) -> list[Job]:
    """The jobs left, the ones that complete a cell first: ordered by how many of their cell's other
    seeds are done (most first), then by cost (cheapest first). A cell: the same overrides but seed."""
    def cell(j: Job) -> tuple[str, ...]:
        return tuple(o for o in j.overrides if not o.startswith("seed="))

    done: dict[tuple[str, ...], int] = {}
    for j in jobs:
        if j.status in ("done", "shared"):
            done[cell(j)] = done.get(cell(j), 0) + 1
    left = [j for j in jobs if j.status in ("to run", "partial", "failed")]
    return sorted(left, key=lambda j: (-done.get(cell(j), 0), j.seconds if j.seconds is not None else float("inf")))


def commands_left(jobs: list[Job]) -> list[str]:
    """One shell command per job left (:func:`left_in_order`), with its estimated cost: to split a
    sweep into runs that fit a session or a core (each is one job of the same sweep; a finished one is
    skipped when the whole sweep runs later)."""
    import shlex

    out = []
    for j in left_in_order(jobs):
        cost = "?" if j.seconds is None else f"~{j.seconds / 60:.0f}"
        out.append(f"omnidraft -m {' '.join(shlex.quote(o) for o in j.overrides)}  # {cost} core-min, {j.status}")
    return out


def render(jobs: list[Job], command: str) -> str:
    """The plan as Markdown: per job its status and cost, then the totals in core-hours."""
    out = [f"# Plan: `{command}`", "",
           "Generated by `omnidraft plan` from the result files. Cost: one-thread core-minutes, measured from a "
           "finished run's rows, estimated (~) for the rest from finished runs alike.", "",
           "| job | status | core-min | note |", "|---|---|---|---|"]
    for j in jobs:
        cost = "–" if j.seconds is None else f"{'~' if j.estimated_from else ''}{j.seconds / 60:.0f}"
        note = "; estimate: ".join(x for x in (j.note, j.estimated_from) if x)
        out.append(f"| `{j.name}` | {j.status} | {cost} | {note} |")
    t = totals(jobs)
    unknown = t["left_uncosted"]
    out += ["", f"Jobs: {t['jobs']} ({', '.join(f'{v} {k}' for k, v in t['by_status'].items())}).",
            f"Done: {t['done_core_hours']:.1f} core-hours measured. Left: {t['left_jobs']} jobs, "
            f"~{t['left_core_hours']:.1f} core-hours"
            + (f" (+{unknown} with no finished run alike to cost them from)" if unknown else "") + ".", ""]
    cmds = commands_left(jobs)
    if cmds:
        out += ["## Left, one command per job", "",
                "Jobs that complete a cell (more of its seeds done) first, then the cheapest; each runs one job of "
                "the sweep above, so the list can be split across cores or sessions."
                + (" XSum jobs read a local copy (no registry ships XSum): set `OMNIDRAFT_XSUM=<its JSONL>` or add "
                   "`paths.xsum=<its JSONL>`." if any(" task=xsum" in c for c in cmds) else ""),
                "", "```bash", *cmds, "```", ""]
    return "\n".join(out)
