"""The analysis notebook runs end to end on a results tree written by the runner and the bench."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_runner import _cfg

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "results_overview.ipynb"


def test_results_notebook_runs_on_real_result_files(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from test_baselines import _cfg as bench_cfg

    from omnidraft.bench import run_bench
    from omnidraft.runner import run

    res = tmp_path / "results"
    run(_cfg(res / "core" / "omnidraft", "method=omnidraft", "task.limit=3", "decode.max_new_tokens=6"))
    run(_cfg(res / "adaptive" / "xv_joint", "ablation=adaptive_joint", "method.adapt.interval=1",
             "task.limit=3", "decode.max_new_tokens=6"))
    run_bench(bench_cfg("bench", "overrides=['debug=tiny']", f"run_dir={tmp_path / 'bench_run'}",
                        f"bench.out_dir={res / 'bench'}", "bench.name=tiny", "bench.tasks=[synthetic]",
                        "bench.limit=1", "decode.max_new_tokens=4", "bench.methods=[ar,pld]", "progress=false"))
    (res / "distill" / "d").mkdir(parents=True)  # a run without decoding rows is skipped
    (res / "distill" / "d" / "summary.json").write_text(json.dumps({"status": "ok"}))
    (res / "distill" / "d" / "metrics.jsonl").write_text(json.dumps({"distill/loss": 1.0}) + "\n")
    # a tiny paper sweep committed as a fixture (omnidraft -m experiment=paper/table5 scale=tiny, 4 cells)
    shutil.copytree(Path(__file__).parent / "fixtures" / "paper_sweep", res / "paper")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec("".join(cell["source"]), ns)  # noqa: S102 - our own notebook
    out = capsys.readouterr().out
    assert "'run': 'core/omnidraft'" in out and "'run': 'adaptive/xv_joint'" in out
    assert "tiny.json | 1 prompts | ok" in out and "pld" in out
    assert "paper/table5/tiny | 4 runs | table5_acceptance.png" in out
    assert "tiny_qwen2 spd_dm 3: acc" in out and "tiny_qwen2 hybrid 4: acc" in out
    figs = res / "notebook_figures"  # its own figures, saved; the results it read are left as they were
    for f in ("acceptance_by_run.png", "acceptance_rolling_core.png", "adaptive_draft_length.png",
              "paper/table5/tiny/table5_acceptance.png"):
        assert (figs / f).stat().st_size > 0, f
    fixture = Path(__file__).parent / "fixtures" / "paper_sweep"
    assert sorted(p.relative_to(res / "paper") for p in (res / "paper").rglob("*")) == \
        sorted(p.relative_to(fixture) for p in fixture.rglob("*"))
