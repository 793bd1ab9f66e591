"""omnidraft.tables: the numbers in results/*/table.md are the arithmetic it claims, committed
tables regenerate from committed results unchanged, and bench rows of every age read alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from omnidraft import tables
from omnidraft.core.decode import GenerationResult, StepRecord

ROOT = Path(__file__).resolve().parent.parent


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


def test_gains_compare_the_same_prompts_so_difficulty_cancels():
    # reference: easy first half (0.8), hard second half (0.4); run: +0.1 on every prompt, in another order
    ref = [_row(i, 8 if i < 4 else 4, 10, 2, 10, 1.0) for i in range(8)]
    run = [_row(i, 9 if i < 4 else 5, 10, 2, 10, 1.0) for i in range(8)]
    first, last = tables.gains(run, ref, window=4)
    assert first == pytest.approx(0.1) and last == pytest.approx(0.1)
    first, last = tables.gains(run, ref[:4], window=4)  # reference lacks the last window's prompts
    assert first == pytest.approx(0.1) and last is None


def test_unfinished_run_is_resummarised_from_its_rows_and_marked_partial(tmp_path):
    rows = [_row(i, 6, 10, 2, 8, 2.0) for i in range(4)]
    stale = {"status": "failed: KeyboardInterrupt", "n_prompts": 2, "accept/rate": 0.123}
    s, partial = tables.run_summary(_write(tmp_path, "adaptive", "sv_joint", rows, stale))
    assert partial and s["n_prompts"] == 4 and s["accept/rate"] == pytest.approx(0.6)
    done = {"status": "ok", "n_prompts": 4, "accept/rate": 0.6}
    s, partial = tables.run_summary(_write(tmp_path, "adaptive", "sv_fixed", rows, done))
    assert not partial and s is not None


def test_blocks_sum_over_the_block_and_time_only_prompts_that_ran_ar(tmp_path):
    rows = [_row(0, 6, 10, 2, 8, 2.0, ar_wall=4.0, draft_len=5.0),  # sd 4 tok/s, ar 2 tok/s
            _row(1, 2, 10, 2, 4, 9.0, draft_len=5.0),               # no ar: not in the speedup
            _row(2, 9, 10, 1, 9, 1.0, ar_wall=9.0, draft_len=10.0)]  # second block
    _write(tmp_path, "adaptive", "sv_fixed", rows)
    text = tables.blocks("adaptive", tmp_path / "results", size=2)
    # block 0-1: acceptance 8/20, 12 tokens / 4 steps, drafted (5*2+5*2)/4, speedup (8/2)/(8/4)
    assert "| 0-1 | 0.400 / 3.00 / 5.00 / 2.00 |" in text
    assert "| 2-3 | 0.900 / 9.00 / 10.00 / 9.00 (1) |" in text


def test_table_lists_every_run_and_marks_missing_ones(tmp_path):
    rows = [_row(i, 7, 10, 2, 8, 2.0, ar_wall=4.0, draft_len=5.0) for i in range(4)]
    _write(tmp_path, "adaptive", "sv_fixed", rows, {"status": "ok", **tables.summarise(rows, True, 50)})
    _write(tmp_path, "adaptive", "sv_joint", rows)  # rows only: a stream still running
    text = tables.stream_table("adaptive", tmp_path / "results")
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines()[2:]}
    assert set(lines) == {"sv_fixed", "sv_joint (partial)", "sv_heuristic", "sv_interleaved", "omnidraft", "xv_joint"}
    assert "not run" in lines["sv_heuristic"] and "not run" in lines["omnidraft"]
    cells = [c.strip() for c in lines["sv_fixed"].strip("|").split("|")]
    assert cells[1:3] == ["4", "0.700"] and cells[6] == "2.00"  # prompts, acc, ..., speedup
    assert cells[-5:-2] == ["sv_fixed", "+0.000", "+0.000"]  # its own reference: zero gain


@pytest.mark.parametrize("group", tables.GROUPS)
def test_committed_tables_regenerate_from_committed_results_unchanged(group):
    committed = ROOT / "results" / group / "table.md"
    assert tables.render(group, ROOT / "results") == committed.read_text()


def test_the_committed_paper_overview_regenerates_from_the_committed_tables_unchanged(monkeypatch):
    """results/paper/overview.md is `omnidraft tables results/paper --overview` of the committed tables'
    JSON files (`omnidraft tables results/paper/<table>/<scale>` writes it again with each table)."""
    from omnidraft.paper_tables import OVERVIEW, render_overview

    monkeypatch.chdir(ROOT)
    assert render_overview(Path("results/paper")) == (ROOT / "results" / "paper" / OVERVIEW).read_text(encoding="utf-8")


def _generation(tokens: list[int], steps: list[tuple[int, int, int]], wall: float) -> GenerationResult:
    return GenerationResult(tokens=tokens, steps=[StepRecord(p, a, e, 0.01 * p, 0.1) for p, a, e in steps],
                            wall_s=wall, prefill_s=0.05)


def test_bench_rows_of_every_age_read_alike():
    ar = _generation([1, 2, 3, 4], [(0, 0, 1)] * 4, wall=2.0)
    sd = _generation([1, 2, 3, 5], [(3, 2, 3), (2, 0, 1)], wall=1.0)
    new = tables.bench_row("spd_dm", "gsm8k", "7", 0, sd, ar, forward_s=0.8, rss_gib=1.5,
                           update={"adapt/update_s": 0.3, "adapt/loss": 1.0})
    assert set(tables.prompt_row(sd, ar)) <= set(new)  # a bench row is a stream row plus the bench's keys
    # the same generation as benches wrote it before the shared schema
    legacy = {"method": "spd_dm", "task": "gsm8k", "prompt/id": "7", "prompt/index": 0, "new_tokens": 4,
              "wall_s": 1.0, "steps": 2, "proposed": 5, "accepted": 2, "forward_s": 0.8, "draft_s": sd.draft_s,
              "target_s": sd.target_s, "ar_new_tokens": 4, "ar_wall_s": 2.0, "speedup": 2.0, "match_ar": False,
              "rss_gib": 1.5, "adapt_s": 0.3}
    read = tables.normalise_row(legacy)
    assert set(read) <= set(new) and all(read[k] == new[k] for k in read)
    assert "adapt/update_s" not in tables.normalise_row({**legacy, "adapt_s": 0.0})  # no update ran
    assert tables.normalise_row(new) == new
    a = tables.bench_summary([new])
    assert a == tables.bench_summary([legacy])
    assert set(tables.BENCH_KEYS) <= set(a)
    assert a["accept/rate"] == pytest.approx(0.4) and a["accept/mean_len"] == 2.0 and a["speed/speedup"] == 2.0
    assert a["lossless/match_rate"] == 0.0 and a["overhead/share"] == pytest.approx(0.2)
    assert a["time/adapt_s"] == 0.3 and a["time/steps"] == 2 and a["new_tokens"] == 4


def test_summary_splits_acceptance_by_draft_source():
    steps = [(3, 3, 4), (4, 1, 2), (0, 0, 1), (5, 0, 1)]
    sd = GenerationResult(tokens=list(range(8)), wall_s=1.0, steps=[
        StepRecord(p, a, e, 0.01, 0.1, source=src) for (p, a, e), src in zip(steps, ["lookup", "model", "model", "lookup"])])
    row = tables.prompt_row(sd, None)
    assert row["sd/step_lookup"] == [1, 0, 0, 1]
    s = tables.summarise([row], True)
    assert s["draft/lookup_accept_rate"] == pytest.approx(3 / 8) and s["draft/lookup_tokens_per_step"] == 2.5
    # the step that proposed nothing counts for neither source
    assert s["draft/model_accept_rate"] == pytest.approx(1 / 4) and s["draft/model_tokens_per_step"] == 2.0
    plain = tables.prompt_row(_generation(list(range(4)), [(3, 1, 2), (2, 2, 3)], wall=1.0), None)
    assert "sd/step_lookup" not in plain and "draft/model_accept_rate" not in tables.summarise([plain], True)


def test_bench_summary_is_summarise_over_the_same_rows():
    ar = _generation([1, 2, 3, 4], [(0, 0, 1)] * 4, wall=2.0)
    rows = [tables.bench_row("pld", "t", str(i), i, _generation([1, 2, 3, 4], [(3, i, i + 1)] * 2, wall=1.0 + i),
                             ar, forward_s=None, rss_gib=1.0, update={}) for i in range(3)]
    a, s = tables.bench_summary(rows), tables.summarise(rows, True)
    assert a["speed/tok_per_s"] == s["speed/sd_tok_per_s_all"] and a["speed/speedup"] == s["speed/speedup"]
    assert a["accept/rate"] == s["accept/rate"] and a["lossless/match_rate"] == s["lossless/match_rate"]
    assert a["overhead/share"] is None and a["time/forward_s"] is None  # not profiled
    assert a["time/adapt_s"] == 0.0 and isinstance(a["time/adapt_s"], float)


def test_bench_counts_certified_divergences_and_says_when_none_were_certified():
    ar = _generation([1, 2, 3, 4], [(0, 0, 1)] * 4, wall=2.0)

    def row(i, tokens, cert=None):
        r = tables.bench_row("sd", "t", str(i), i, _generation(tokens, [(3, 2, 3), (1, 0, 1)], wall=1.0), ar,
                             forward_s=None, rss_gib=1.0, update={})
        return {**r, **(cert or {})}

    tie = {"lossless/near_tie": True, "lossless/gap_batched": 0.0}
    rows = [row(0, [1, 2, 3, 4]), row(1, [1, 2, 9, 9], tie), row(2, [1, 9, 9, 9], {"lossless/near_tie": False})]
    assert tables.bench_summary(rows)["lossless/unexplained"] == 1
    assert tables.bench_summary(rows[:2])["lossless/unexplained"] == 0
    assert tables.bench_summary([row(1, [1, 2, 9, 9])])["lossless/unexplained"] is None  # an older, uncertified bench


def test_tables_command_writes_the_table(tmp_path, monkeypatch, capsys):
    from omnidraft import cli

    rows = [_row(i, 7, 10, 2, 8, 2.0, ar_wall=4.0, draft_len=5.0) for i in range(4)]
    _write(tmp_path, "core", "spd_dm", rows, {"status": "ok", **tables.summarise(rows, True, 50)})
    monkeypatch.setattr(sys, "argv", ["omnidraft", "tables", "core", "--results", str(tmp_path / "results")])
    cli.main()
    text = (tmp_path / "results" / "core" / "table.md").read_text()
    assert text == tables.render("core", tmp_path / "results") and "| spd_dm | 4 |" in text
    assert text in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["omnidraft", "tables", "nope", "--results", str(tmp_path / "results")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2 and "omnidraft: error: tables: unknown group 'nope'" in capsys.readouterr().err


def test_replay_check_compares_each_run_with_live_and_the_replays_with_each_other(tmp_path):
    def run(name: str, steps: list[tuple[list[int], list[int]]], losses: list[float | None], engine: str) -> None:
        rows = [{"prompt/index": i, "sd/step_proposed": p, "sd/step_accepted": a, "sd/proposed": sum(p),
                 "sd/accepted": sum(a), "text/output": f"out{i}", "sd/wall_s": 1.0}
                | ({"adapt/loss": loss} if loss is not None else {})
                for i, ((p, a), loss) in enumerate(zip(steps, losses))]
        _write(tmp_path, "replay_check", name, rows, {"engine": engine, "provenance": {"torch_threads": 1}})

    base = [([3, 3], [1, 2]), ([3, 3, 3], [0, 3, 1])]
    run("live", base, [None, 2.0], "live")
    run("replay_a", base, [None, 2.2], "replay")  # every step as live, the update's loss 10% off
    run("replay_b", [base[0], ([3, 3, 3], [0, 2, 1])], [None, 2.0], "replay")  # one step of prompt 1 differs
    run("trace", base, [None, None], "live")  # the check's target trace beside the runs: not a run
    (tmp_path / "results" / "replay_check" / "trace" / "trace.jsonl").write_text("{}\n")
    text = tables.replay_check_table(tmp_path / "results")
    assert "| trace |" not in text
    live_part, pair_part = text.split("The other runs against each other")
    row = {cells[0].strip("| "): cells for cells in (line.split(" | ") for line in live_part.splitlines()
                                                    if line.startswith("| replay"))}
    assert row["replay_a"][2:9] == ["2", "2/2", "5/5", "2/2", "1", "1.0e-01", f"{7 / 15:.4f}"]
    assert row["replay_b"][2:9] == ["2", "1/2", "4/5", "2/2", "1", "0.0e+00", f"{6 / 15:.4f}"]
    pairs = [line.rstrip(" |").split(" | ") for line in pair_part.splitlines() if line.startswith("| replay")]
    assert len(pairs) == 1 and pairs[0][:2] == ["| replay_a", "replay_b"]
    assert pairs[0][2:8] == ["2", "1/2", "4/5", "2/2", "1", f"{0.2 / 2.2:.1e}"]
