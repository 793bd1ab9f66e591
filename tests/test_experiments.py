"""The paper's tables as experiments (conf/experiment/paper): every one composes and checks at every
scale (its sweep expanded job by job), runs end to end as a tiny multirun, and ``omnidraft tables``
turns the sweep into the paper's layout. The sweep is robust: a failed job records its error and the
sweep goes on, a re-run skips finished jobs, a bad override fails in one line before any job starts,
frozen greedy cells run at seed 0 only, and the submitit launcher (the code SLURM uses) runs it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF_DIR, one_error_line
from hydra import compose, initialize_config_dir

from omnidraft.cli import sweep_jobs
from omnidraft.config import register_configs
from omnidraft.paper_tables import cell_stats, paper_numbers, read_runs, write_paper_tables
from omnidraft.runner import check_config

FROZEN_ROWS = {"spd_dm", "sd", "distillspec"}  # rows in which nothing learns online (conf/row)
EXPERIMENTS = sorted(f"paper/{p.stem}" for p in (Path(CONF_DIR) / "experiment" / "paper").glob("*.yaml"))
SCALES = ("paper", "cpu", "tiny")
STREAMS = ("paper/target_switch", "paper/task_switch")  # the stream protocol: no train/test split


def _jobs(*over: str) -> list[list[str]]:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return sweep_jobs(list(over), compose)


def _compose(job: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", *job])


def _sweep(tmp: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "omnidraft", "-m", *args], capture_output=True, text=True,
                          cwd=tmp, env=env, timeout=timeout)


def test_there_is_an_experiment_per_paper_table():
    have = {e.split("/")[1] for e in EXPERIMENTS}
    for table in ("table1", "table2", "table3", "table5", "table6", "table6_t1", "table12", "table14", "figure2",
                  "target_switch", "task_switch"):
        assert table in have
    assert set(paper_numbers()["tables"]) >= {"table1", "table2", "table3", "table5", "table6", "table12", "table14"}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_checks_at_every_scale(experiment, scale):
    jobs = _jobs(f"experiment={experiment}", f"scale={scale}")
    assert jobs
    for job in jobs:
        cfg = _compose(job)
        check_config(cfg)
        assert cfg.protocol == ("stream" if experiment in STREAMS else "train_test")
        if experiment == "paper/task_switch" and scale != "tiny":  # both orders of the two tasks
            assert cfg.task.name == "switch" and cfg.task.limit == 2 * cfg.task.switch_at
            assert sorted(cfg.task.components) == ["gsm8k", "mbpp_humaneval"]
        if experiment == "paper/target_switch":  # a named schedule, from the run's own target
            ts = cfg.target_switch
            assert ts.targets[0] == cfg.target.name and len(ts.targets) == len(ts.at) + 1 >= 3
            assert len(set(ts.targets)) == (2 if ts.schedule == "back_and_forth" else 1), list(ts.targets)
        if scale == "paper":
            assert (cfg.task.preset == "paper" or experiment in STREAMS) and cfg.method.temperature > 0
            assert cfg.target.source == "hub" and cfg.drafter.source == "hub"  # the paper's models, by hub id
        if scale == "cpu":
            assert cfg.target.source == "gguf_package" and cfg.drafter.source == "gguf_package"
        if scale == "tiny":
            assert cfg.target.source == "tiny" and cfg.drafter.source == "tiny" and cfg.task.name == "synthetic"
            # cross-vocabulary as the paper's tables are (a Llama-2 tokenizer drafting for a Qwen2 one);
            # Table 2 is the paper's same-vocabulary table
            assert (cfg.drafter.name == cfg.target.name) == (experiment == "paper/table2"), experiment


def test_cpu_scale_maps_each_table_to_its_registry_pair():
    t1 = _jobs("experiment=paper/table1", "scale=cpu")
    assert {tuple(o for o in j if o.split("=")[0] in ("target", "drafter")) for j in t1} == \
        {("target=qwen25_coder_15b", "drafter=smollm2_135m")}
    assert {o for j in t1 for o in j if o.startswith("task=")} == \
        {"task=gsm8k", "task=mbpp_humaneval", "task=alpaca", "task=xsum"}
    t2 = _compose(_jobs("experiment=paper/table2", "scale=cpu")[0])
    assert (t2.target.name, t2.drafter.name, t2.method.adapt.lora_rank) == ("qwen25_coder_15b", "qwen25_coder_05b", 32)
    t6 = [_compose(j) for j in _jobs("experiment=paper/table6_t1", "scale=cpu")]
    assert all(c.method.temperature == 1.0 and c.engine == "live" and c.method.verify == "paper" for c in t6)
    ranks = {_compose(j).method.adapt.lora_rank for j in _jobs("experiment=paper/table12", "scale=cpu")}
    assert ranks == {8, 32, 128}
    paper = _jobs("experiment=paper/table1", "scale=paper")  # targets x tasks x rows at seed 0, then seeds 1, 2
    assert len(paper) == 2 * 4 * 6 + 2  # the later seeds on the first job only: checked, not multiplied
    assert [[o for o in j if o.startswith("seed=")] for j in (paper[0], *paper[-2:])] == [["seed=0"], ["seed=1"], ["seed=2"]]
    assert [[o for o in j if not o.startswith("seed=")] for j in paper[-2:]] == \
        [[o for o in paper[0] if not o.startswith("seed=")]] * 2


def test_a_bad_override_fails_in_one_line_before_any_job(tmp_path):
    proc = _sweep(tmp_path, "experiment=paper/table5", "scale=tiny", "method.k=3,-1", f"hydra.sweep.dir={tmp_path}/s")
    one_error_line(proc, "method.k")
    assert not (tmp_path / "s").exists()
    proc = _sweep(tmp_path, "experiment=paper/table1", "scale=tiny", "row=spd_dm,no_such_row",
                  f"hydra.sweep.dir={tmp_path}/s")
    one_error_line(proc, "no_such_row")
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Every paper experiment as a tiny multirun (2 test + 2 train prompts per job)."""
    tmp = tmp_path_factory.mktemp("sweeps")
    out = {}
    for exp in EXPERIMENTS:
        d = tmp / exp.replace("/", "_")
        out[exp] = (d, _sweep(tmp, f"experiment={exp}", "scale=tiny", f"hydra.sweep.dir={d}"))
    return tmp, out


def test_every_experiment_runs_as_a_tiny_multirun(smoke):
    _, out = smoke
    for exp, (d, proc) in out.items():
        assert proc.returncode == 0, (exp, proc.stderr[-3000:])
        assert "omnidraft: error:" not in proc.stderr, (exp, proc.stderr[-3000:])
        runs = read_runs(d)
        assert runs and all(r.status == "ok" for r in runs), exp
        assert len(runs) == len(_jobs(f"experiment={exp}", "scale=tiny")), exp
        for r in runs:
            s = r.summary
            assert s["choices"]["experiment"] == exp and s["choices"]["scale"] == "tiny"
            # cross-vocab (the direct map covers part of the target's vocabulary), Table 2 one tokenizer
            assert (s["drafter"] == s["target"]) == (exp == "paper/table2"), (exp, s["drafter"], s["target"])
            if exp == "paper/target_switch":  # per target: a stream to the other tokenizer's target and back,
                # and the control that stays on it (one segment)
                t = s["target"]
                other = {"tiny_qwen2": "tiny_llama3", "tiny_llama3": "tiny_qwen2"}[t]
                want = [t, other, t] if r.get("target_switch.schedule") == "back_and_forth" else [t]
                assert [b["target"] for b in s["by_target"]] == want, r.path
                assert r.get("target_switch.targets") == (want if len(want) == 3 else [t, t, t])
                continue
            if exp == "paper/task_switch":  # scale=tiny fixes task=synthetic: the sweep runs, not the switch
                assert s["protocol"] == "stream" and s["n_prompts"] == 4
                continue
            assert s["protocol"] == "train_test" and s["n_test"] == 2
            # a frozen row (nothing learns) skips the train stream, which cannot change its test figures
            assert s["n_train_prompts"] == (0 if "train/skipped" in s else 2), (exp, r.path)
            assert ("train/skipped" in s) == (r.row in FROZEN_ROWS), (exp, r.row)


def test_tables_of_a_sweep_in_the_paper_layout(smoke):
    tmp, out = smoke
    d, _ = out["paper/table5"]
    (tmp / "overview.md").write_text("stale")  # an overview above the sweep dir is kept true
    files = {p.name for p in write_paper_tables(d)}
    assert {"table5.md", "table5.tex", "table5.json", "table5_acceptance.png", "table5_draft_length.png",
            "overview.md"} <= files
    assert "| table5 (paper_table5) | [paper_table5/table5.md](paper_table5/table5.md) | 10 |" in (tmp / "overview.md").read_text()
    md = (d / "table5.md").read_text()
    assert "| SpD_DM | 3 |" in md and "| L_DM + cache | 4 |" in md and "paper" in md
    cells = json.loads((d / "table5.json").read_text())["cells"]
    assert {(c["row"], c["col"]) for c in cells} == {(r, k) for r in ("spd_dm", "cache_pp", "l_dm", "l_dm_cache", "hybrid")
                                                     for k in (3, 4)}
    for c in cells:
        assert 0 <= c["acc"] <= 1 and c["n"] == 2 and c["acc_ci"][0] <= c["acc"] <= c["acc_ci"][1]
    d, _ = out["paper/target_switch"]
    write_paper_tables(d, plots=False)
    md = (d / "target_switch.md").read_text()
    # the switching stream's segments beside its first target's control, which the sweep ran too
    # (the tiny sweep runs from target=tiny_qwen2 only: the Llama-3 target has no control there)
    seg = [ln for ln in md.splitlines() if ln.startswith("| hybrid s0 |")]
    assert len(seg) == 3, md
    assert seg[0].startswith("| hybrid s0 | 1 | tiny_qwen2 | 0..1 |") and "(0..1) |" in seg[0]
    assert seg[1].startswith("| hybrid s0 | 2 | tiny_llama3 | 2..3 |") and "no control run" in seg[1]
    assert seg[2].startswith("| hybrid s0 | 3 | tiny_qwen2 | 4..5 |") and "(4..5) |" in seg[2]


def test_pooled_bootstrap_matches_the_point_estimate():
    from omnidraft.paper_tables import Cell, Run

    rows = [{"sd/accepted": a, "sd/proposed": 10, "sd/new_tokens": a + 3, "sd/steps": 3, "speed/modelled_sd_s": 0.3,
             "speed/modelled_ar_step_s": 0.05} for a in range(10)]
    run = Run(Path("x"), {}, {"method": {"temperature": 0.0}}, "paper/table1", "spd_dm", 0, "ok")
    st = cell_stats(Cell("t", "spd_dm", "gsm8k", [run], rows), n_boot=500)
    assert st["acc"] == pytest.approx(45 / 100)
    assert st["speedup"] == pytest.approx((75 / 30) / ((3.0 / 30) / 0.05))
    assert st["acc_ci"][0] < st["acc"] < st["acc_ci"][1] and st["speedup_ci"][0] < st["speedup"] < st["speedup_ci"][1]
    assert st["seed_independent"] and st["n"] == 10
    # seeds run on two machines (two speed models): the point estimate is the bootstrap's statistic of all rows
    import numpy as np

    from omnidraft.paper_tables import _stats, _vectors
    from omnidraft.tables import summarise

    mixed = [{**r, "speed/modelled_ar_step_s": 0.05 if i % 2 else 0.1} for i, r in enumerate(rows)]
    st = cell_stats(Cell("t", "spd_dm", "gsm8k", [run], mixed), n_boot=50)
    assert st["speedup"] == pytest.approx(float(_stats(_vectors(mixed), np.arange(len(mixed)))[1]))
    # a target-switch stream: rows of a slow and a fast target with different token counts. Plain decoding
    # costs each row's tokens at its own target's step, so the speedup is sum(new * ar_step) / sum(sd_s),
    # not the one from the unweighted mean step (42% lower on these rows)
    switch = [{**r, "sd/new_tokens": 60 if i % 2 else 4, "speed/modelled_ar_step_s": 0.1 if i % 2 else 0.01}
              for i, r in enumerate(rows)]
    want = (5 * 60 * 0.1 + 5 * 4 * 0.01) / (10 * 0.3)
    st = cell_stats(Cell("t", "hybrid", "gsm8k", [run], switch), n_boot=50)
    assert st["speedup"] == pytest.approx(want)
    assert float(_stats(_vectors(switch), np.arange(len(switch)))[1]) == pytest.approx(want)
    assert summarise(switch, greedy=True)["speed/modelled_speedup"] == pytest.approx(want)


def test_row_orderings_are_compared_with_the_papers_pair_by_pair():
    """Each pair of rows both report, in the paper's order: same order or not, and whether our 95%
    intervals separate; the rendered section names them and ranks ours best first."""
    from omnidraft.paper_tables import Cell, compare_orderings, render_orderings

    ours = {"spd_dm": {"acc": 0.30, "acc_ci": (0.28, 0.32)}, "l_dm": {"acc": 0.40, "acc_ci": (0.37, 0.43)},
            "hybrid": {"acc": 0.39, "acc_ci": (0.36, 0.42)}, "osd": {"acc": 0.5, "acc_ci": (0.45, 0.55)}}
    paper = {"spd_dm": 0.1, "l_dm": 0.32, "hybrid": 0.42, "hybrid_lora": 0.37}
    v = compare_orderings(ours, paper)
    assert v["agree"] == [("l_dm", "spd_dm"), ("hybrid", "spd_dm")]
    assert v["reversed_ci_overlap"] == [("hybrid", "l_dm")] and not v["reversed"] and not v["agree_ci_overlap"]
    assert compare_orderings({"a": {"acc": 0.2, "acc_ci": (0.1, 0.25)}, "b": {"acc": 0.5, "acc_ci": (0.4, 0.6)}},
                             {"a": 0.3, "b": 0.2})["reversed"] == [("a", "b")]
    spec = {"cols": "task", "rows": ["spd_dm", "l_dm", "hybrid"],
            "cells": [{"target": "llama3_8b", "row": r, "col": "gsm8k", "acc": a} for r, a in paper.items()]}
    cells = {("t", r, "gsm8k"): Cell("t", r, "gsm8k") for r in ours}
    text = "\n".join(render_orderings(spec, cells, {("t", r, "gsm8k"): st for r, st in ours.items()}))
    assert "OSD (not in the paper) (0.500) > L_DM (0.400) ≈ L_DM + λ L_Ngram (0.390) > SpD_DM (0.300)" in text
    assert "| L_DM + λ L_Ngram > L_DM |" in text and "(Llama3-8B)" in text
    assert render_orderings(spec, {("t", "osd", "gsm8k"): Cell("t", "osd", "gsm8k")},
                            {("t", "osd", "gsm8k"): ours["osd"]}) == []  # no pair both report: no section
    one = {"spd_dm": {"acc": 0.3, "acc_ci": None}, "l_dm": {"acc": 0.4, "acc_ci": (0.3, 0.5)}}
    v = compare_orderings(one, {"spd_dm": 0.1, "l_dm": 0.3, "hybrid": 0.3})
    assert v["agree_ci_overlap"] == v["no_ci"] == [("l_dm", "spd_dm")]
    assert compare_orderings({**one, "hybrid": one["l_dm"]}, {"l_dm": 0.3, "hybrid": 0.3})["paper_tie"] == [("l_dm", "hybrid")]


def test_a_one_row_table_orders_its_columns_against_the_papers():
    """Table 12 has one row and the LoRA rank as columns: its ordering section ranks the ranks."""
    from omnidraft.paper_tables import Cell, render_orderings

    paper = {8: 0.30, 32: 0.37, 128: 0.38}
    ours = {8: {"acc": 0.44, "acc_ci": (0.40, 0.47)}, 32: {"acc": 0.45, "acc_ci": (0.41, 0.48)},
            128: {"acc": 0.30, "acc_ci": (0.27, 0.33)}}
    spec = {"cols": "method.adapt.lora_rank", "rows": ["hybrid_lora"],
            "cells": [{"target": "llama3_8b", "row": "hybrid_lora", "col": c, "acc": a} for c, a in paper.items()]}
    cells = {("t", "hybrid_lora", c): Cell("t", "hybrid_lora", c) for c in ours}
    text = "\n".join(render_orderings(spec, cells, {("t", "hybrid_lora", c): st for c, st in ours.items()}))
    assert "## Ordering of the columns by acceptance" in text
    assert "lora_rank=32 (0.450) ≈ lora_rank=8 (0.440) > lora_rank=128 (0.300)" in text
    assert "lora_rank=128 (0.38) > lora_rank=32 (0.37) > lora_rank=8 (0.3)" in text
    assert "| lora_rank=32 > lora_rank=8 |" in text  # agrees, intervals overlap
    assert "| lora_rank=128 > lora_rank=8; lora_rank=128 > lora_rank=32 |" in text  # reversed, separated


def test_a_failed_job_is_recorded_the_sweep_goes_on_and_a_rerun_skips_finished_jobs(tmp_path):
    d = tmp_path / "s"
    # the second job fails at run time (a file that does not exist), the others go on
    args = ["experiment=paper/table12", "scale=tiny", "method.adapt.lora_rank=8,16", "task=synthetic,gsm8k",
            "task.source=local", f"task.path={tmp_path}/missing.jsonl", f"hydra.sweep.dir={d}"]
    proc = _sweep(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = sorted(d.rglob("error.txt"))
    assert len(errors) == 2 and all("missing.jsonl" in e.read_text() for e in errors)
    ok = [r for r in read_runs(d) if r.status == "ok"]
    assert len(ok) == 2  # the synthetic task ignores task.path: both of its jobs ran
    assert proc.stderr.count("the sweep goes on") == 2
    # omnidraft plan: the same jobs, found in the same directories, with their state and a cost
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    (tmp_path / "plans").mkdir()
    (tmp_path / "overview.md").write_text("stale")  # the overview above the plans' dir is written again
    _table_json(tmp_path / "table12" / "tiny", "table12", [])
    plan = subprocess.run([sys.executable, "-m", "omnidraft", "plan", *args, f"--out={tmp_path}/plans/plan.md"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "| table12 (tiny) |" in (tmp_path / "overview.md").read_text()
    text = (tmp_path / "plans" / "plan.md").read_text()
    assert text.count("| done |") == 2 and text.count("| failed |") == 2
    assert "missing.jsonl" in text and "Jobs: 4 (2 done, 2 failed)" in text and "Left: 2 jobs, ~" in text
    assert all(f"`{r.path.relative_to(d)}` | done" in text for r in ok)  # the whole name: task.path holds '/'
    data = json.loads((tmp_path / "plans" / "plan.json").read_text())  # the same plan as data, beside it
    assert data["totals"]["by_status"] == {"done": 2, "failed": 2} and data["totals"]["left_jobs"] == 2
    assert sorted(j["status"] for j in data["jobs"]) == ["done", "done", "failed", "failed"]
    assert data["totals"]["done_core_hours"] == pytest.approx(
        sum(j["core_s"] for j in data["jobs"] if j["status"] == "done") / 3600)

    bad = subprocess.run([sys.executable, "-m", "omnidraft", "plan", "scale=tiny"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=600)
    assert bad.returncode == 2
    one_error_line(bad, "plan: name the sweep")
    again = _sweep(tmp_path, *args)
    assert again.stderr.count("finished earlier, skipped") == 2
    assert again.stderr.count("the sweep goes on") == 2


def test_frozen_greedy_cells_run_at_seed_0_only(tmp_path):
    # the experiment's own sweep directory: <paths.results_dir>/paper/<table>/<scale>/<the cell's overrides>
    proc = _sweep(tmp_path, "experiment=paper/table1", "scale=tiny", "row=spd_dm,hybrid", "seed=0,1",
                  f"paths.results_dir={tmp_path}/results")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = tmp_path / "results" / "paper" / "table1" / "tiny"
    assert (d / "drafter=tiny_llama2,row=hybrid,seed=1,target=tiny_qwen2,task=synthetic").is_dir()
    runs = {(r.row, r.seed) for r in read_runs(d) if r.status == "ok"}
    assert runs == {("spd_dm", 0), ("hybrid", 0), ("hybrid", 1)}
    assert "seed-independent" in proc.stderr


def test_the_submitit_launcher_runs_a_sweep(tmp_path):
    d = tmp_path / "s"
    proc = _sweep(tmp_path, "experiment=paper/figure2", "scale=tiny", "hydra/launcher=submitit_local",
                  f"hydra.sweep.dir={d}", "hydra.launcher.timeout_min=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = read_runs(d)
    assert len(runs) == 1 and runs[0].status == "ok" and (d / ".submitit").is_dir()


def test_the_ray_launcher_runs_a_sweep_records_a_failed_job_and_skips_finished_ones(tmp_path):
    # the optional extra `.[ray]` (hydra-ray-launcher); CI does not install it, so this runs where it is installed
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    d = tmp_path / "s"
    # a local Ray instance with one CPU, so the two jobs run one after the other in Ray's worker processes;
    # the gsm8k job reads a file that does not exist and fails, the synthetic one ignores task.path
    args = ["experiment=paper/figure2", "scale=tiny", "task=synthetic,gsm8k", "task.source=local",
            f"task.path={tmp_path}/missing.jsonl", "hydra/launcher=ray_cpu", "hydra.launcher.ray.init.num_cpus=1",
            f"hydra.sweep.dir={d}"]
    proc = _sweep(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = list(d.rglob("error.txt"))
    assert len(errors) == 1 and "missing.jsonl" in errors[0].read_text()
    ok = [r for r in read_runs(d) if r.status == "ok"]
    assert len(ok) == 1 and ok[0].get("task.name") == "synthetic"
    summary = ok[0].path / "summary.json"
    before = summary.read_text()
    again = _sweep(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished earlier, skipped" in again.stdout + again.stderr and summary.read_text() == before


def _fake_run(d: Path, targets: list[str], at: list[int], accepted: list[int], status: str = "ok",
              seed: int = 0) -> None:
    """A stream run directory of experiment paper/target_switch: config, summary, one row per prompt
    (10 proposed, ``accepted[i]`` accepted)."""
    d.mkdir(parents=True)
    ts = f"{{targets: [{', '.join(targets)}], at: [{', '.join(map(str, at))}]}}" if len(targets) > 1 else \
        "{targets: [], at: []}"
    (d / "config.yaml").write_text(f"seed: {seed}\ntarget: {{name: {targets[0]}}}\ntask: {{name: gsm8k, offset: 0}}\n"
                                   f"method: {{name: omnidraft, temperature: 0.0}}\ntarget_switch: {ts}\n")
    (d / "summary.json").write_text(json.dumps({"status": status, "target": targets[0], "task": "gsm8k",
                                                "protocol": "stream", "n_prompts": len(accepted),
                                                "choices": {"experiment": "paper/target_switch", "row": "hybrid"}}))
    bounds = [0, *at]
    rows = []
    for i, a in enumerate(accepted):
        tgt = targets[max(j for j, b in enumerate(bounds) if b <= i)] if len(targets) > 1 else targets[0]
        rows.append({"prompt/index": i, "target": tgt, "sd/accepted": a, "sd/proposed": 10, "sd/new_tokens": a + 2,
                     "sd/steps": 2})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_switch_segment_sits_beside_a_control_stream_on_the_same_prompts(tmp_path):
    # switch A > B > A at prompts 2 and 4; A's control never switches; B has no control run;
    # the switch run was cut after 5 prompts (status failed): its last segment shows prompt 4 only
    _fake_run(tmp_path / "switch", ["A", "B", "A"], [2, 4], [5, 6, 0, 1, 2], status="failed")
    _fake_run(tmp_path / "ctl_a", ["A"], [], [5, 6, 7, 8, 9, 10])
    write_paper_tables(tmp_path, plots=False)
    md = (tmp_path / "target_switch.md").read_text()
    # a stream's cells are over its prompts as it goes, not test prompts after training
    assert "stream prompts 6 (protocol=stream" in md and "train prompts" not in md and "test prompts" not in md
    assert "on the stream's prompts as it goes" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| hybrid s0")]
    assert len(rows) == 3
    assert rows[0].startswith("| hybrid s0 (failed) | 1 | A | 0..1 | 0.550") and "0.550" in rows[0].split("|")[6]
    assert "| 2 | B | 2..3 | 0.050" in rows[1] and "no control run" in rows[1]
    # segment 3: A is back on prompts 4..5 but reached prompt 4 only; the control on 4..5: (9 + 10) / 20
    assert "| 3 | A | 4..4 | 0.200" in rows[2] and "0.950" in rows[2] and "(4..5)" in rows[2]
    assert rows[2].rstrip().endswith("| – |")  # one prompt: no interval, so no verdict
    assert rows[0].rstrip().endswith("| no |")  # prompts 0..1 agree with the control's
    # the control is its own column of the table, not pooled with the switching run
    cells = json.loads((tmp_path / "target_switch.json").read_text())["cells"]
    assert [(c["target"], c["col"]) for c in cells] == [("A", "–")]


def _fake_task_run(d: Path, comps: list[str], at: int, accepted: list[int], seed: int = 0) -> None:
    """A stream run directory of experiment paper/task_switch: ``comps[0]``'s prompts 0..at-1, then
    ``comps[1]``'s from 0 (rows carry their task and prompt id)."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed: {seed}\ntarget: {{name: T}}\ntask: {{name: switch, offset: 0, "
                                   f"components: [{', '.join(comps)}], switch_at: {at}}}\n"
                                   "method: {name: omnidraft, temperature: 0.0}\ntarget_switch: {targets: [], at: []}\n")
    (d / "summary.json").write_text(json.dumps({"status": "ok", "target": "T", "task": "switch", "protocol": "stream",
                                                "n_prompts": len(accepted),
                                                "choices": {"experiment": "paper/task_switch", "row": "hybrid"}}))
    rows = [{"prompt/index": i, "task": comps[i >= at], "prompt/id": str(i if i < at else i - at), "target": "T",
             "sd/accepted": a, "sd/proposed": 10, "sd/new_tokens": a + 2, "sd/steps": 2} for i, a in enumerate(accepted)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_task_switch_segment_sits_beside_the_other_orders_stream_on_the_same_prompts(tmp_path):
    """GSM8K then MBPP+HumanEval, and the other order: each stream's second task beside the same
    prompts (task and id) in the stream that starts on it; a first segment has no control; pooled
    over two seeds."""
    for seed, (ab, ba) in enumerate((([5, 5, 1, 3], [7, 7, 2, 2]), ([5, 5, 3, 3], [9, 9, 2, 4]))):
        _fake_task_run(tmp_path / f"ab{seed}", ["gsm8k", "mbpp_humaneval"], 2, ab, seed=seed)
        _fake_task_run(tmp_path / f"ba{seed}", ["mbpp_humaneval", "gsm8k"], 2, ba, seed=seed)
    files = {p.name for p in write_paper_tables(tmp_path)}
    assert {"task_switch.md", "task_switch_segments.png"} <= files
    md = (tmp_path / "task_switch.md").read_text()
    assert "## Per task segment (task switch)" in md and "| run | segment | task |" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| hybrid s0 from gsm8k |")]
    assert len(rows) == 2
    assert "| 1 | gsm8k | 0..1 | 0.500" in rows[0] and "the stream starts on it" in rows[0]
    # MBPP+HumanEval after GSM8K, (1 + 3) / 20, beside its first two prompts fresh: (7 + 7) / 20
    assert "| 2 | mbpp_humaneval | 2..3 | 0.200" in rows[1] and "0.700" in rows[1] and "(0..1)" in rows[1]
    back = next(ln for ln in md.splitlines() if ln.startswith("| hybrid s0 from mbpp_humaneval | 2 |"))
    assert "| gsm8k | 2..3 | 0.200" in back and "0.500" in back
    pooled = next(ln for ln in md.splitlines() if ln.startswith("| hybrid pooled s0,1 from gsm8k | 2 |"))
    assert "| 0.250" in pooled and "0.800" in pooled  # (1+3+3+3) / 40 beside (7+7+9+9) / 40
    cells = json.loads((tmp_path / "task_switch.json").read_text())["cells"]
    assert len(cells) == 2  # one column per order


def _fake_figure2_run(d: Path, seed: int, accepted: dict[int, list[int]]) -> None:
    """A train_test run directory of experiment paper/figure2: two train prompts, then the test set
    evaluated after each number of train prompts in ``accepted`` (10 proposed per prompt)."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed: {seed}\ntarget: {{name: T}}\ntask: {{name: gsm8k, offset: 0}}\n"
                                   "method: {name: omnidraft, temperature: 0.0}\nprotocol: train_test\n")
    (d / "summary.json").write_text(json.dumps({"status": "ok", "target": "T", "task": "gsm8k", "protocol": "train_test",
                                                "choices": {"experiment": "paper/figure2", "row": "hybrid"}}))
    rows = [{"phase": "train", "prompt/index": i, "sd/accepted": 5, "sd/proposed": 10, "sd/new_tokens": 7,
             "sd/steps": 2} for i in range(2)]
    rows += [{"phase": "test", "eval/at": at, "prompt/index": i, "sd/accepted": a, "sd/proposed": 10,
              "sd/new_tokens": a + 2, "sd/steps": 2, "sd/step_accepted": [a // 2, a - a // 2],
              "sd/step_proposed": [5, 5]} for at, accs in accepted.items() for i, a in enumerate(accs)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_figure2s_test_set_points_are_pooled_over_seeds_per_evaluation(tmp_path):
    """Each evaluation of the test set (after 0 and 2 train prompts) pooled over two seeds, with its
    interval and whether it separates from the first; the cell itself is the last evaluation."""
    _fake_figure2_run(tmp_path / "s0", 0, {0: [1, 2, 1, 2], 2: [8, 9, 8, 9]})
    _fake_figure2_run(tmp_path / "s1", 1, {0: [1, 2, 1, 2], 2: [7, 8, 9, 8]})
    files = {p.name for p in write_paper_tables(tmp_path)}
    assert "figure2_acceptance.png" in files
    cell = json.loads((tmp_path / "figure2.json").read_text())["cells"][0]
    assert cell["acc"] == pytest.approx(66 / 80) and cell["seeds"] == [0, 1] and cell["n"] == 8
    assert [e["at"] for e in cell["evals"]] == [0, 2]
    first, last = cell["evals"]
    # before training both seeds decoded the same steps: one copy counts, not two (a narrower interval)
    assert first["acc"] == pytest.approx(6 / 40) and first["n"] == 4 and first["seeds"] == [0, 1] and first["identical"]
    assert not last["identical"] and last["n"] == 8
    assert last["acc"] == pytest.approx(cell["acc"]) and last["acc_ci"] == pytest.approx(cell["acc_ci"])
    md = (tmp_path / "figure2.md").read_text()
    assert "## The test set over the train stream" in md
    pts = [ln for ln in md.splitlines() if ln.startswith("| T | L_DM + λ L_Ngram | gsm8k |")]
    assert len(pts) == 2, md
    assert pts[0].startswith("| T | L_DM + λ L_Ngram | gsm8k | 0 | 0.150") and pts[0].endswith("| 4 | 2 (identical) | – |")
    assert pts[1].startswith("| T | L_DM + λ L_Ngram | gsm8k | 2 | 0.825") and pts[1].endswith("| higher, separated |")
    # a run that evaluated once has no such section
    one = tmp_path / "one"
    _fake_figure2_run(one / "s0", 0, {2: [8, 9, 8, 9]})
    write_paper_tables(one, plots=False)
    assert "over the train stream" not in (one / "figure2.md").read_text()
    assert "evals" not in json.loads((one / "figure2.json").read_text())["cells"][0]
    # one seed evaluated before training too, the others at the end only: the last point pools every seed,
    # as the cell does, and the first is that one seed's
    _fake_figure2_run(one / "s1", 1, {2: [7, 8, 9, 8]})
    _fake_figure2_run(one / "s2", 2, {0: [1, 2, 1, 2], 2: [6, 6, 6, 6]})
    write_paper_tables(one, plots=False)
    cell = json.loads((one / "figure2.json").read_text())["cells"][0]
    assert cell["seeds"] == [0, 1, 2] and cell["n"] == 12 and cell["acc"] == pytest.approx(90 / 120)
    first, last = cell["evals"]
    assert first["seeds"] == [2] and first["n"] == 4 and not first["identical"]
    assert last["seeds"] == [0, 1, 2] and last["n"] == 12 and last["acc"] == pytest.approx(cell["acc"])
    assert last["acc_ci"] == pytest.approx(cell["acc_ci"])


def test_the_rolling_curves_of_figure2_are_the_cells_formulas_over_each_window():
    """Figure 2's lines: acceptance and modelled speedup over each window of train prompts, the same
    formulas a table cell uses (:func:`_stats`), replay rows (modelled times) and rows without timing."""
    import numpy as np

    from omnidraft.paper_tables import _stats, _vectors, rolling

    rows = [{"sd/accepted": a, "sd/proposed": 10, "sd/new_tokens": a + 3, "sd/steps": 3 + a % 2,
             "speed/modelled_sd_s": 0.3 + 0.01 * a, "speed/modelled_ar_step_s": 0.05} for a in (1, 7, 3, 9, 2, 8)]
    x, acc, sp = rolling(rows, 3)
    assert list(x) == [3, 4, 5, 6]
    for i, end in enumerate(x):
        want = _stats(_vectors(rows), np.arange(end - 3, end))
        assert acc[i] == pytest.approx(float(want[0])) and sp[i] == pytest.approx(float(want[1]))
    assert acc[0] == pytest.approx(11 / 30) and sp[0] != sp[1]
    x, acc, sp = rolling([{k: v for k, v in r.items() if not k.startswith("speed/")} for r in rows], 2)
    assert sp is None and acc[-1] == pytest.approx(10 / 20)


def test_switch_segments_pool_over_seeds_beside_their_pooled_controls(tmp_path):
    """Two seeds of the stream A > B > A, each beside its seed's control; one stream from B: rows name
    where each stream starts, and the pooled rows put each segment over both seeds beside the pooled
    controls, or say which seed's control is missing."""
    for seed, acc in ((0, [5, 5, 1, 1, 4, 4]), (1, [7, 7, 3, 3, 6, 6])):
        _fake_run(tmp_path / f"ab{seed}", ["A", "B", "A"], [2, 4], acc, seed=seed)
        _fake_run(tmp_path / f"ca{seed}", ["A"], [], [5, 5, 5, 5, 5, 5], seed=seed)
    _fake_run(tmp_path / "cb0", ["B"], [], [2, 2, 2, 2, 2, 2])
    _fake_run(tmp_path / "ba0", ["B", "A", "B"], [2, 4], [2, 2, 5, 5, 2, 2])
    files = {p.name for p in write_paper_tables(tmp_path)}
    assert {"target_switch_segments.png", "target_switch_acceptance.png"} <= files  # segments beside controls
    md = (tmp_path / "target_switch.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| hybrid ")]
    assert sum(ln.startswith("| hybrid s0 from A |") for ln in rows) == 3
    assert sum(ln.startswith("| hybrid s0 from B |") for ln in rows) == 3
    pooled = [ln for ln in rows if ln.startswith("| hybrid pooled s0,1 from A |")]
    assert len(pooled) == 3 and not any("pooled s0 from B" in ln for ln in rows)  # one seed: no pooled rows
    # segment 1 (A, prompts 0..1): (5 + 5 + 7 + 7) / 40 = 0.600 beside the controls' 20 / 40 = 0.500
    assert "| 1 | A | 0..1 | 0.600" in pooled[0] and "| 0.500" in pooled[0] and "(0..1)" in pooled[0]
    # segment 2 (B): seed 1 has no B control
    assert "| 2 | B | 2..3 | 0.200" in pooled[1] and "no finished control for s1" in pooled[1]
    # the plot's data: the pooled rows stand for the A-first schedule, the B-first stream (one seed) for itself
    from omnidraft.paper_tables import read_runs, switch_segments

    segs = switch_segments(read_runs(tmp_path))
    assert len({g["schedule"] for g in segs}) == 2 and sum(g["pooled"] for g in segs) == 3
    # a seed's run twice (the same cell under two job names) pools once; a cut control says so
    _fake_run(tmp_path / "ab0_again", ["A", "B", "A"], [2, 4], [5, 5, 1, 1, 4, 4])
    _fake_run(tmp_path / "cb1", ["B"], [], [2, 2, 2], status="failed", seed=1)
    write_paper_tables(tmp_path, plots=False)
    md = (tmp_path / "target_switch.md").read_text()
    assert "pooled s0,1 from A" in md and "pooled s0,0" not in md
    s1_b = next(ln for ln in md.splitlines() if ln.startswith("| hybrid s1 from A | 2 | B |"))
    assert "(2..2; control failed)" in s1_b
    s1_a3 = next(ln for ln in md.splitlines() if ln.startswith("| hybrid s1 from A | 3 | A |"))
    assert "(4..5)" in s1_a3  # A's control of seed 1 finished


def test_plot_legends_name_each_target_by_its_shortest_distinct_prefix():
    from omnidraft.paper_tables import _short_names

    assert _short_names(["qwen25_coder_15b", "gemma3_270m", "qwen25_coder_15b"]) == ["qwen25", "gemma3", "qwen25"]
    assert _short_names(["qwen25_14b", "qwen25_7b"]) == ["qwen25_14b", "qwen25_7b"]  # not both `qwen25`
    assert _short_names(["tiny_qwen2", "tiny_llama3"]) == ["tiny_qwen2", "tiny_llama3"]


def test_a_cell_another_table_computed_is_copied_not_run_again(tmp_path):
    """Table 6's `hybrid` cell is Table 1's (the same resolved config and seed): a Table 6 sweep after
    Table 1's copies it (rows, summary with its own choices and `shared_from`) instead of decoding."""
    res = tmp_path / "results"
    p1 = _sweep(tmp_path, "experiment=paper/table1", "scale=tiny", "row=hybrid", f"paths.results_dir={res}")
    assert p1.returncode == 0, p1.stderr[-2000:]
    p6 = _sweep(tmp_path, "experiment=paper/table6", "scale=tiny", "row=hybrid,loss_nll_only", f"paths.results_dir={res}")
    assert p6.returncode == 0, p6.stderr[-2000:]
    assert p6.stderr.count("copied, not run again") == 1, p6.stderr[-2000:]
    (src,) = read_runs(res / "paper" / "table1" / "tiny")
    runs = {r.row: r for r in read_runs(res / "paper" / "table6" / "tiny")}
    shared, own = runs["hybrid"], runs["loss_nll_only"]
    assert shared.summary["shared_from"] == str(src.path.relative_to(res)) and "shared_from" not in own.summary
    assert shared.experiment == "paper/table6" and shared.status == "ok"
    assert (shared.path / "metrics.jsonl").read_text() == (src.path / "metrics.jsonl").read_text()
    assert shared.summary["cell"] == src.summary["cell"] != own.summary["cell"]
    write_paper_tables(res / "paper" / "table6" / "tiny", plots=False)
    cells = json.loads((res / "paper" / "table6" / "tiny" / "table6.json").read_text())["cells"]
    assert {c["row"] for c in cells} == {"hybrid", "loss_nll_only"}


def test_a_cell_is_shared_whatever_interpolation_source_or_code_version_wrote_it(tmp_path):
    """Table 14's `l_dm` cell reads no ngram_reference_size (only its evict_* rows do), so Table 1's
    MBPP+HE `l_dm` run is its cell although the two experiments set that key differently; so is a run
    whose config.yaml predates a key newer code added (its summary's key then differs). A run that
    wrote another value of a key that matters is not."""
    import yaml

    from omnidraft.cli import find_shared_cell
    from omnidraft.lifecycle import cell_key, portable_config, resolve_dtypes

    res = tmp_path / "results"
    pair = ["scale=tiny", "task=mbpp_humaneval", "seed=0", f"paths.results_dir={res}"]
    t1 = _compose(["experiment=paper/table1", "row=l_dm", *pair])
    l_dm, evict = (_compose(["experiment=paper/table14", f"row={r}", *pair]) for r in ("l_dm", "evict_lru_quarter"))
    assert t1.ngram_reference_size != l_dm.ngram_reference_size and cell_key(t1) == cell_key(l_dm)
    src = res / "paper" / "table1" / "tiny" / "row=l_dm"

    def finished(config: dict, key: str) -> None:
        src.mkdir(parents=True, exist_ok=True)
        (src / "config.yaml").write_text(yaml.safe_dump(config))
        (src / "summary.json").write_text(json.dumps({"status": "ok", "cell": key}))

    resolve_dtypes(t1)  # as a run writes its config.yaml: device and dtype resolved
    written = portable_config(t1)
    finished(written, cell_key(t1))
    assert find_shared_cell(l_dm, tmp_path / "t14")[0] == src
    assert find_shared_cell(evict, tmp_path / "t14")[0] is None
    older = {**written, "method": {k: v for k, v in written["method"].items() if k != "draft_length"}}
    finished(older, "a key older code computed")
    assert find_shared_cell(l_dm, tmp_path / "t14")[0] == src
    finished({**written, "method": {**written["method"], "k": int(written["method"]["k"]) + 1}}, "another")
    assert find_shared_cell(l_dm, tmp_path / "t14")[0] is None
    # a key the older run lacks but this job sets off its default is another cell
    finished(older, "a key older code computed")
    confident = _compose(["experiment=paper/table14", "row=l_dm", *pair, "method.draft_length.min_prob=0.9"])
    assert find_shared_cell(confident, tmp_path / "t14")[0] is None


def test_a_named_target_schedule_is_the_cell_of_its_explicit_list():
    """paper/target_switch's `target_switch.schedule` only feeds `targets`: a sweep job naming it is
    the same cell as a run that listed the same targets, and another schedule is another cell."""
    from omnidraft.lifecycle import cell_key

    base = ["experiment=paper/target_switch", "scale=tiny", "target=tiny_qwen2", "drafter=tiny_qwen2", "task=synthetic",
            "target_switch.at=[2,4]", "protocol=stream"]
    named = _compose([*base, "target_switch.schedule=back_and_forth"])
    assert list(named.target_switch.targets) == ["tiny_qwen2", "tiny_llama3", "tiny_qwen2"]
    listed = _compose([*base, "target_switch.targets=[tiny_qwen2,tiny_llama3,tiny_qwen2]", "target_switch.schedule=null"])
    stay = _compose([*base, "target_switch.schedule=stay"])
    assert cell_key(named) == cell_key(listed) != cell_key(stay)
    # a run written before the named schedules existed (no schedule, schedules or partners) is the cell
    from omnidraft.lifecycle import cell_fingerprint, portable_config, resolve_dtypes, same_cell

    resolve_dtypes(listed)
    old = portable_config(listed)
    old["target_switch"] = {"targets": old["target_switch"]["targets"], "at": old["target_switch"]["at"]}
    assert same_cell(old, cell_fingerprint(named)) and not same_cell(old, cell_fingerprint(stay))


def test_a_named_schedule_refuses_an_explicit_list_beside_it_and_a_target_without_partner():
    from omnidraft.errors import OmniDraftError
    from omnidraft.runner import check_target_switch

    base = ["experiment=paper/target_switch", "scale=tiny", "drafter=tiny_qwen2", "task=synthetic",
            "target_switch.at=[2,4]", "protocol=stream"]
    both = _compose([*base, "target=tiny_qwen2", "target_switch.schedule=stay",
                     "target_switch.targets=[tiny_qwen2,tiny_llama3,tiny_qwen2]"])
    with pytest.raises(OmniDraftError, match=r"is given, but target_switch.schedule=stay picks .* pass "
                                             r"target=tiny_qwen2 target_switch.schedule=null"):
        check_target_switch(both)
    check_target_switch(_compose([*base, "target=tiny_qwen2", "target_switch.schedule=null",
                                  "target_switch.targets=[tiny_qwen2,tiny_llama3,tiny_qwen2]"]))  # your own list
    # a target the experiment names no partner for: its control composes, its switching stream says what to add
    check_target_switch(_compose([*base, "target=tiny_llama2", "target_switch.schedule=stay"]))
    with pytest.raises(OmniDraftError, match="no partner for tiny_llama2: add target_switch.partners.tiny_llama2="):
        check_target_switch(_compose([*base, "target=tiny_llama2", "target_switch.schedule=back_and_forth"]))
    with pytest.raises(OmniDraftError, match="schedule=nope: no such schedule; known: back_and_forth, stay"):
        check_target_switch(_compose([*base, "target=tiny_qwen2", "target_switch.schedule=nope",
                                      "target_switch.targets=[tiny_qwen2,tiny_llama3,tiny_qwen2]"]))


def test_tables_of_a_results_directory_are_written_per_sweep_never_mixing_scales(tmp_path):
    """`omnidraft tables results/paper`: each sweep directory (Hydra's multirun.yaml) gets its own
    table of its own runs; a run directory alone gets its own, its sweep's left as it was."""
    import shutil

    fixture = Path(__file__).parent / "fixtures" / "paper_sweep" / "table5" / "tiny"
    for scale in ("tiny", "cpu"):
        shutil.copytree(fixture, tmp_path / "paper" / "table5" / scale)
        (tmp_path / "paper" / "table5" / scale / "multirun.yaml").write_text("{}\n")
    cpu = tmp_path / "paper" / "table5" / "cpu"
    for run in [d for d in cpu.iterdir() if d.is_dir() and "k=4" in d.name]:
        shutil.rmtree(run)  # the cpu sweep: k=3 only
    written = write_paper_tables(tmp_path / "paper", plots=False)
    assert sorted(str(f.relative_to(tmp_path)) for f in written) == sorted(
        f"paper/table5/{sc}/table5.{ext}" for sc in ("cpu", "tiny") for ext in ("md", "tex", "json"))
    cells = {sc: json.loads((tmp_path / "paper" / "table5" / sc / "table5.json").read_text())["cells"]
             for sc in ("cpu", "tiny")}
    assert len(cells["tiny"]) == 4 and len(cells["cpu"]) == 2  # each of its own runs
    before = (cpu / "table5.md").read_text()
    one = next(d for d in cpu.iterdir() if d.is_dir())
    (f, *_) = write_paper_tables(one, plots=False)
    assert f.parent == one and (cpu / "table5.md").read_text() == before


def test_tables_of_any_other_sweep_list_each_run_by_its_own_overrides(tmp_path):
    """`omnidraft tables DIR` on a sweep that is no paper experiment: sweep.md, one line per run,
    labelled by the overrides that differ, with acceptance and tokens per step from its rows."""
    for i, (k, acc) in enumerate(((5, [5, 5]), (12, [8, 9]))):
        d = tmp_path / str(i)
        _fake_run(d, ["A"], [], acc)
        (d / "summary.json").write_text(json.dumps({"status": "ok", "target": "A", "task": "gsm8k", "choices": {}}))
        (d / "provenance.json").write_text(json.dumps({"overrides": ["method=pld", f"method.k={k}"]}))
    (f,) = write_paper_tables(tmp_path, plots=False)
    md = f.read_text()
    assert f.name == "sweep.md" and "Shared overrides: method=pld." in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| 0 ") or ln.startswith("| 1 ")]
    assert lines[0].startswith("| 0 | method.k=5 | ok | 2 | 0.500 [") and "| 3.50 |" in lines[0]
    assert lines[1].startswith("| 1 | method.k=12 | ok | 2 | 0.850 [") and "| 5.25 |" in lines[1]


def test_plan_costs_a_job_by_its_own_number_of_test_evaluations(tmp_path):
    """A finished train_test run's cost splits into loading, its train stream and one evaluation of
    the test set; a job that evaluates five times (Figure 2) is costed with five, from train_test runs
    only (a stream-protocol run of the same row is not alike)."""
    from omnidraft.config import evaluation_points
    from omnidraft.plan import Job, estimate, run_cost

    assert evaluation_points(100, 25, True, True) == [0, 25, 50, 75, 100]
    assert evaluation_points(100, 0, False, True) == [100] and evaluation_points(100, 25, False, False) == [0]

    def finished(name: str, rows: list[dict]) -> Job:
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps({"status": "ok", "time/load_s": 6.0}))
        cost = run_cost(d)[0]
        return Job([], d, name, "hybrid", "gsm8k", True, "t", status="done", seconds=cost.total(), cost=cost)

    test = [{"phase": "test", "eval/at": at, "sd/wall_s": 3.0} for at in (0, 4) for _ in range(2)]
    train = [{"phase": "train", "sd/wall_s": 10.0, "adapt/update_s": 2.0} for _ in range(4)]
    tt = finished("tt", test + train)
    assert (tt.cost.fixed, tt.cost.stream, tt.cost.per_eval, tt.cost.evals) == (6.0, 48.0, 6.0, 2)
    stream = finished("stream", [{"sd/wall_s": 1.0}])
    jobs = [Job([], tmp_path / "a", "a", "hybrid", "gsm8k", True, "t", evals=5),
            Job([], tmp_path / "b", "b", "hybrid", "gsm8k", True, "t", evals=None)]
    estimate(jobs, [tt, stream])
    assert jobs[0].seconds == pytest.approx(6.0 + 48.0 + 5 * 6.0) and jobs[0].estimated_from.startswith("1 of")
    assert jobs[1].seconds == pytest.approx(7.0)  # a stream job from the stream run


def test_plan_lists_a_command_per_job_left_completing_cells_first(tmp_path):
    """The plan's commands: one per job left, shell-quoted, the jobs whose cell has most seeds done
    first, then the cheapest; finished and shared jobs are not listed."""
    from omnidraft.plan import Job, commands_left, render

    def job(row: str, seed: int, status: str = "to run", minutes: float | None = 30.0) -> Job:
        over = ["experiment=paper/target_switch", "scale=cpu", f"row={row}", f"seed={seed}", "target_switch.at=[25,50]"]
        return Job(over, tmp_path / f"{row}{seed}", f"{row}{seed}", row, "gsm8k", True, "t", status=status,
                   seconds=None if minutes is None else minutes * 60)

    jobs = [job("a", 0, "done"), job("a", 1, "shared"), job("a", 2, minutes=50),  # a: 2 seeds done
            job("b", 0, "done"), job("b", 1), job("b", 2, minutes=20),             # b: 1 seed done
            job("c", 0, minutes=None), job("c", 1, "failed", minutes=10)]           # c: none
    cmds = commands_left(jobs)
    assert [c.split("row=")[1].split()[0] + c.split("seed=")[1].split()[0] for c in cmds] == \
        ["a2", "b2", "b1", "c1", "c0"]
    assert cmds[0] == ("omnidraft -m experiment=paper/target_switch scale=cpu row=a seed=2 "
                       "'target_switch.at=[25,50]'  # ~50 core-min, to run")
    assert cmds[-1].endswith("# ? core-min, to run") and "failed" in cmds[3]
    assert "## Left, one command per job" in render(jobs, "omnidraft -m x") and "```bash" in render(jobs, "x")
    assert "## Left" not in render([job("a", 0, "done")], "x")
    assert "OMNIDRAFT_XSUM" not in render(jobs, "x")
    xsum = Job(["experiment=paper/table1", "scale=cpu", "task=xsum", "seed=1"], tmp_path / "x", "x", "hybrid", "xsum",
               True, "t", status="to run", seconds=60.0)
    assert "set `OMNIDRAFT_XSUM=<its JSONL>` or add `paths.xsum=<its JSONL>`" in render([xsum], "x")


def test_plan_costs_a_job_from_runs_on_its_engine_scaled_to_its_own_prompts(tmp_path):
    """A live job is costed from live runs (a replay does not run the target), per prompt of its own
    stream and test set; with no run on its engine it falls back to the others and says so."""
    from omnidraft.plan import Job, estimate, run_cost

    def finished(name: str, engine: str, train_s: float) -> Job:
        d = tmp_path / name
        d.mkdir()
        rows = [{"phase": "train", "prompt/index": i, "sd/wall_s": train_s} for i in range(4)]
        rows += [{"phase": "test", "eval/at": 4, "prompt/index": i, "prompt/turn": t, "sd/wall_s": 0.5}
                 for i in range(2) for t in range(2)]  # two test prompts of two turns each
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps({"status": "ok", "time/load_s": 5.0}))
        cost = run_cost(d)[0]
        return Job([], d, name, "hybrid", "gsm8k", True, "t", status="done", seconds=cost.total(), cost=cost,
                   engine=engine)

    replay, live = finished("replay", "replay", 10.0), finished("live", "live", 40.0)
    assert (live.cost.n_stream, live.cost.n_test, live.cost.stream, live.cost.per_eval) == (4, 2, 160.0, 2.0)

    def job(name: str, engine: str) -> Job:
        return Job([], tmp_path / name, name, "other_row", "gsm8k", True, "t", evals=1, engine=engine,
                   stream_prompts=2, test_prompts=6)

    jobs = [job("l", "live"), job("r", "replay")]
    estimate(jobs, [replay, live])
    assert jobs[0].seconds == pytest.approx(5.0 + 2 * 40.0 + 6 * 1.0)  # the live run, per prompt
    assert jobs[1].seconds == pytest.approx(5.0 + 2 * 10.0 + 6 * 1.0)  # the replay
    assert jobs[0].estimated_from == jobs[1].estimated_from == "1 of other tables' runs, that train"
    lone = [job("l2", "live")]
    estimate(lone, [replay])
    assert lone[0].seconds == pytest.approx(5.0 + 2 * 10.0 + 6 * 1.0)
    assert lone[0].estimated_from == ("1 of other tables' runs, that train, any engine, some replay: this job "
                                      "runs live, so the estimate is rough")


def _table_json(path: Path, name: str, cells: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps({"experiment": f"paper/{name}", "provenance": {}, "cells": cells,
                                                   "failed": []}))


def test_the_overview_counts_each_tables_seeds_and_pairs_against_the_paper(tmp_path):
    """``omnidraft tables DIR --overview``: per table JSON under DIR, its cells, the trained cells at 3
    seeds, the pairs by verdict against every paper target, and each pair reversed with separated
    intervals spelled out; a table whose paper cells share no pair with ours says so; files that
    are not a table's JSON are ignored; a directory without any gives one error line."""
    from omnidraft.errors import OmniDraftError
    from omnidraft.paper_tables import render_overview

    def cell(row, acc, lo, hi, seeds, frozen=False, col="gsm8k", target="t"):
        return {"target": target, "row": row, "col": col, "n": 50 * len(seeds), "seeds": seeds,
                "seed_independent": frozen, "acc": acc, "acc_ci": [lo, hi]}

    # the paper (Table 1, GSM8K): hybrid > l_dm > spd_dm for Llama3-8B and Qwen2-7B alike; ours puts
    # l_dm above hybrid with separated intervals
    _table_json(tmp_path / "table1" / "cpu", "table1", [
        cell("spd_dm", 0.30, 0.28, 0.32, [0], frozen=True), cell("l_dm", 0.50, 0.47, 0.53, [0, 1, 2]),
        cell("hybrid", 0.40, 0.37, 0.43, [0, 1])])
    _table_json(tmp_path / "table3" / "cpu", "table3", [  # the paper gives Table 3's hybrid row only
        cell("spd_dm", 0.3, 0.2, 0.4, [0], frozen=True), cell("hybrid", 0.4, 0.3, 0.5, [0, 1, 2])])
    (tmp_path / "plans").mkdir()  # omnidraft plan's JSON: the jobs left and their cost
    jobs = [{"name": "row=hybrid,seed=2", "status": "to run", "core_s": 1200.0},
            {"name": "row=l_dm,seed=0", "status": "done", "core_s": 900.0},
            {"name": "row=hybrid,seed=1", "status": "failed", "core_s": 600.0}]
    (tmp_path / "plans" / "table1_cpu.json").write_text(json.dumps({"jobs": jobs, "totals": {"left_core_hours": 0.5}}))
    shared = [jobs[0], {"name": "row=spd_dm,seed=0", "status": "to run", "core_s": 1800.0},  # one job is table1's too
              {"name": "row=l_dm,seed=0", "status": "done", "core_s": 0.0},  # table1's cell, copied: costs nothing
              {"name": "row=hybrid,seed=0", "status": "done", "core_s": 2700.0}]
    (tmp_path / "plans" / "table3_cpu.json").write_text(json.dumps({"jobs": shared, "totals": {"left_core_hours": 0.8}}))
    run = tmp_path / "table1" / "cpu" / "some_run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"experiment": "paper/summary", "cells": []}))
    text = render_overview(tmp_path)
    assert ("| table1 (cpu) | [table1/cpu/table1.md](table1/cpu/table1.md) | 3 | 1/2 | 2-3 | 4 / 0 / 0 / 2 | 0 | "
            "~0.5 core-h, 2 jobs |") in text
    assert ("| table3 (cpu) | [table3/cpu/table3.md](table3/cpu/table3.md) | 2 | 1/1 | 3 | – (no pair both report) | 0 | "
            "~0.8 core-h, 2 jobs |") in text
    assert "cpu: ~1.0 core-hours, 3 jobs." in text  # the shared job once
    assert "cpu: ~1.0 core-hours spent in 2 jobs, ~2.0 in all." in text  # 900 + 2700 s done, the copy once at its cost
    assert "Trained cells at 3 seeds, all tables: 2 of 3 " in text
    assert text.index("table1 (cpu)") < text.index("table3 (cpu)") and "summary" not in text.split("## Reversed")[0]
    rev = text.split("## Reversed with separated intervals")[1]
    assert ("- table1 (cpu), t, gsm8k, Llama3-8B: ours L_DM 0.500 [0.470, 0.530] above L_DM + λ L_Ngram 0.400 "
            "[0.370, 0.430]; the paper L_DM + λ L_Ngram 0.42 above L_DM 0.32") in rev
    assert rev.count("\n- ") == 2  # the same pair against Qwen2-7B
    assert "**No reason recorded** (add one to reasons.yaml)" in rev and "Reversed pairs: 2, 0 with a reason" in text
    # a reason for the pair against Llama3-8B only, one for every target, one that matches no reversed pair:
    # the most specific wins, the stale one is listed
    (tmp_path / "reasons.yaml").write_text(
        "reasons:\n"
        "  - {experiment: table1, pair: [hybrid, l_dm], reason: any target}\n"
        "  - {experiment: table1, pair: [hybrid, l_dm], held: gsm8k, paper_target: llama3_8b, reason: Llama only}\n"
        "  - {experiment: table1, pair: [l_dm, spd_dm], reason: agrees now}\n")
    text = render_overview(tmp_path)
    rev = text.split("## Reversed with separated intervals")[1]
    assert "Llama3-8B: ours L_DM" in rev and "above L_DM 0.32. Why: Llama only" in rev
    assert "Qwen2-7B: ours L_DM" in rev and rev.count("Why: any target") == 1 and "Reversed pairs: 2, 2 with a reason" in text
    assert "match no reversed pair now" in text and "- table1: l_dm > spd_dm" in text and "any target" not in \
        text.split("match no reversed pair now")[1]
    (tmp_path / "reasons.yaml").write_text("reasons:\n  - {experiment: table1, pair: [hybrid], reason: x}\n")
    with pytest.raises(OmniDraftError, match="reasons.yaml: entry 1 .* needs experiment, pair \\[higher, lower\\] and reason"):
        render_overview(tmp_path)
    (tmp_path / "reasons.yaml").unlink()
    _table_json(tmp_path / "table1" / "cpu", "table1", [cell("l_dm", 0.3, 0.2, 0.4, [0]), cell("hybrid", 0.4, 0.3, 0.5, [0])])
    assert "## Reversed with separated intervals\n\nNone." in render_overview(tmp_path)
    (tmp_path / "plans" / "table3_cpu.json").write_text('{"jobs": [')  # a plan cut mid-write: one line naming the fix
    with pytest.raises(OmniDraftError, match="table3_cpu.json: not a readable plan; write it again"):
        render_overview(tmp_path)
    (tmp_path / "plans" / "table3_cpu.json").unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, "-m", "omnidraft", "tables", str(tmp_path / "empty"), "--overview"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2
    one_error_line(p, "empty", "no paper table's JSON file")
