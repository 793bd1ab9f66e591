"""experiments/make_tables.py: the numbers in results/*/table.md are the arithmetic it claims."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "make_tables.py"


@pytest.fixture()
def mt(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_tables", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "ROOT", tmp_path)  # results/ read from a tree this test writes
    return mod


def _row(i: int, accepted: int, proposed: int, steps: int, new: int, wall: float, ar_wall: float | None = None,
         draft_len: float | None = None) -> dict:
    r = {"prompt/index": i, "sd/accepted": accepted, "sd/proposed": proposed, "sd/steps": steps,
         "sd/new_tokens": new, "sd/wall_s": wall, "sd/draft_s": wall / 2, "sd/target_s": wall / 2}
    if ar_wall is not None:
        r.update({"ar/new_tokens": new, "ar/wall_s": ar_wall, "ar/steps": new, "ar/target_s": ar_wall,
                  "lossless/match": True})
    if draft_len is not None:
        r["draft/mean_len"] = draft_len
    return r


def _write(root: Path, group: str, name: str, rows: list[dict], summary: dict | None = None) -> Path:
    d = root / "results" / group / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_gains_compare_the_same_prompts_so_difficulty_cancels(mt):
    # reference: easy first half (0.8), hard second half (0.4); run: +0.1 on every prompt, in another order
    ref = [_row(i, 8 if i < 4 else 4, 10, 2, 10, 1.0) for i in range(8)]
    run = [_row(i, 9 if i < 4 else 5, 10, 2, 10, 1.0) for i in range(8)]
    first, last = mt.gains(run, ref, window=4)
    assert first == pytest.approx(0.1) and last == pytest.approx(0.1)
    first, last = mt.gains(run, ref[:4], window=4)  # reference lacks the last window's prompts
    assert first == pytest.approx(0.1) and last is None


def test_unfinished_run_is_resummarised_from_its_rows_and_marked_partial(mt, tmp_path):
    rows = [_row(i, 6, 10, 2, 8, 2.0) for i in range(4)]
    stale = {"status": "failed: KeyboardInterrupt", "n_prompts": 2, "accept/rate": 0.123}
    s, partial = mt.load(_write(tmp_path, "adaptive", "sv_joint", rows, stale))
    assert partial and s["n_prompts"] == 4 and s["accept/rate"] == pytest.approx(0.6)
    done = {"status": "ok", "n_prompts": 4, "accept/rate": 0.6}
    s, partial = mt.load(_write(tmp_path, "adaptive", "sv_fixed", rows, done))
    assert not partial and s is not None


def test_blocks_sum_over_the_block_and_time_only_prompts_that_ran_ar(mt, tmp_path):
    rows = [_row(0, 6, 10, 2, 8, 2.0, ar_wall=4.0, draft_len=5.0),  # sd 4 tok/s, ar 2 tok/s
            _row(1, 2, 10, 2, 4, 9.0, draft_len=5.0),               # no ar: not in the speedup
            _row(2, 9, 10, 1, 9, 1.0, ar_wall=9.0, draft_len=10.0)]  # second block
    _write(tmp_path, "adaptive", "sv_fixed", rows)
    text = mt.blocks("adaptive", size=2)
    # block 0-1: acceptance 8/20, 12 tokens / 4 steps, drafted (5*2+5*2)/4, speedup (8/2)/(8/4)
    assert "| 0-1 | 0.400 / 3.00 / 5.00 / 2.00 |" in text
    assert "| 2-3 | 0.900 / 9.00 / 10.00 / 9.00 (1) |" in text


def test_table_lists_every_run_and_marks_missing_ones(mt, tmp_path):
    rows = [_row(i, 7, 10, 2, 8, 2.0, ar_wall=4.0, draft_len=5.0) for i in range(4)]
    from omnidraft.tables import summarise

    _write(tmp_path, "adaptive", "sv_fixed", rows, {"status": "ok", **summarise(rows, True, 50)})
    _write(tmp_path, "adaptive", "sv_joint", rows)  # rows only: a stream still running
    text = mt.table("adaptive")
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines()[2:]}
    assert set(lines) == {"sv_fixed", "sv_joint (partial)", "sv_heuristic", "sv_interleaved", "omnidraft", "xv_joint"}
    assert "not run" in lines["sv_heuristic"] and "not run" in lines["omnidraft"]
    cells = [c.strip() for c in lines["sv_fixed"].strip("|").split("|")]
    assert cells[1:3] == ["4", "0.700"] and cells[6] == "2.00"  # prompts, acc, ..., speedup
    assert cells[-5:-2] == ["sv_fixed", "+0.000", "+0.000"]  # its own reference: zero gain
