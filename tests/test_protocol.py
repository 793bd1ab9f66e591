"""The paper's protocol (``protocol=train_test``) and ``engine=replay`` through the runner, on tiny
models: adapt over a disjoint train slice, evaluate frozen on the test prompts every N train prompts
(the dynamics rows), the same run replayed from target traces equals the live one, and every bad
input is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_run, metrics_rows, one_error_line

from omnidraft.calibrate import run_calibrate
from omnidraft.errors import OmniDraftError
from omnidraft.runner import run, train_stream_config
from omnidraft.trace import run_trace

N_NEW = 16
BASE = ["debug=tiny", "task=gsm8k", "task.limit=3", f"decode.max_new_tokens={N_NEW}", "logger=none", "progress=false",
        "warmup_prompts=1"]
PROTOCOL = ["protocol=train_test", "train_test.train_limit=4", "train_test.eval_every=2", "method.adapt.interval=2"]


def _cfg(tmp: Path, name: str, *over: str, config: str = "config"):
    return compose_run(tmp, name, BASE, *over, config=config)


def _rows(d: Path) -> list[dict]:
    return metrics_rows(d)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("protocol")
    # one thread, as the runs compared with it pin: their losses are compared exactly, and an earlier
    # run in this process may have set torch's thread count (threads=N is process-wide)
    return tmp, run(_cfg(tmp, "live", *PROTOCOL, "threads=1"))


def test_train_test_adapts_on_train_and_evaluates_frozen_on_test(live):
    tmp, s = live
    rows = _rows(tmp / "live")
    test = [r for r in rows if r["phase"] == "test"]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["prompt/id"] for r in train] == ["200", "201", "202", "203"]  # GSM8K test 200.. is the train slice
    assert [(r["eval/at"], r["prompt/id"]) for r in test] == [(at, str(j)) for at in (0, 2, 4) for j in range(3)]
    assert sum("adapt/loss" in r for r in train) == 2 and not any("adapt/loss" in r for r in test)
    # evaluation is frozen: the n-gram cache after an evaluation is the one before it
    sizes = [(r["phase"], r.get("eval/at"), r["ngram/size"]) for r in rows]
    for (ph, at, n), (ph2, _, n2) in zip(sizes, sizes[1:]):
        if ph == "test" and ph2 == "test":
            assert n2 == n
    assert s["protocol"] == "train_test" and s["eval/at"] == 4 and s["n_prompts"] == 3 and s["n_train_prompts"] == 4
    assert [d["eval/at"] for d in s["dynamics"]] == [0, 2, 4]
    assert all("accept/rate" in d and "speed/speedup" in d for d in s["dynamics"])
    assert s["train_offset"] == 200 and s["test_offset"] == 0 and "train/adapt/n_updates" in s


def test_train_test_replay_equals_live(live, tmp_path):
    """The same run from target traces: the same steps, outputs and losses, speed modelled."""
    tmp, _ = live
    cfg = _cfg(tmp, "unused", *PROTOCOL, "engine=replay")
    for c in (cfg, train_stream_config(cfg)):  # the test slice's trace, then the train slice's
        t = c.task
        run_trace(_cfg(tmp, f"trace_{t.offset}", f"task.offset={t.offset}", f"task.limit={t.limit}", config="trace"))
    run_calibrate(_cfg(tmp, "cal", "calibrate.repeats=2", "calibrate.warmup=1", "calibrate.context_tokens=32",
                       "threads=1", config="calibrate"))
    s = run(_cfg(tmp, "replay", *PROTOCOL, "engine=replay", "threads=1"))
    a, b = _rows(tmp / "live"), _rows(tmp / "replay")
    key = ("phase", "prompt/id", "sd/step_proposed", "sd/step_accepted", "text/output")
    assert [tuple(r[k] for k in key) for r in a] == [tuple(r[k] for k in key) for r in b]
    for x, y in zip(a, b):
        if "adapt/loss" in x:
            assert y["adapt/loss"] == pytest.approx(x["adapt/loss"], rel=1e-5)
    assert s["engine"] == "replay" and s["speed/modelled_speedup"] > 0
    assert all("speed/modelled_speedup" in d for d in s["dynamics"])
    assert s["replay/trace_lines"] == 3 and s["replay/train_trace_lines"] == 4 and len(s["replay/trace_sha256"]) == 64
    assert "speed/speedup" not in s  # no ar baseline is decoded under replay


def test_a_task_switch_replays_each_task_from_its_own_trace(tmp_path):
    """``task=switch`` (GSM8K, then MBPP+HumanEval) under engine=replay: each task segment from its
    task's own trace, the stream's offset carried into the right component; the same steps, outputs
    and losses as the live stream. A missing trace names that task's command; a shuffled switch, a
    single replay.trace and a target switch besides are refused before any model loads."""
    sw = ["task=switch", "task.components=[gsm8k,mbpp_humaneval]", "task.switch_at=2", "task.offset=1",
          "task.limit=3", "method.adapt.interval=2", "threads=1"]  # GSM8K 1, then MBPP+HumanEval 0 and 1
    run(_cfg(tmp_path, "live", *sw, "measure_baseline=false"))

    def trace(task: str, off: int, n: int) -> None:
        run_trace(_cfg(tmp_path, f"trace_{task}", f"task={task}", f"task.offset={off}", f"task.limit={n}",
                       config="trace"))

    run_calibrate(_cfg(tmp_path, "cal", "calibrate.repeats=2", "calibrate.warmup=1", "calibrate.context_tokens=32",
                       "threads=1", config="calibrate"))
    trace("gsm8k", 1, 1)
    with pytest.raises(OmniDraftError, match="omnidraft trace .*task=mbpp_humaneval task.offset=0 task.limit=2$"):
        run(_cfg(tmp_path, "none", *sw, "engine=replay"))
    trace("mbpp_humaneval", 0, 2)
    s = run(_cfg(tmp_path, "replay", *sw, "engine=replay"))
    a, b = _rows(tmp_path / "live"), _rows(tmp_path / "replay")
    key = ("task", "prompt/id", "sd/step_proposed", "sd/step_accepted", "text/output")
    assert [r["task"] for r in a] == ["gsm8k", "humaneval", "humaneval"]  # MBPP+HumanEval: HumanEval first
    assert [tuple(r[k] for k in key) for r in a] == [tuple(r[k] for k in key) for r in b]
    assert sum("adapt/loss" in r for r in a) == 1
    for x, y in zip(a, b):
        if "adapt/loss" in x:
            assert y["adapt/loss"] == pytest.approx(x["adapt/loss"], rel=1e-4, abs=1e-6)
    assert s["replay/trace_lines"] == 3 and set(s["replay/tasks"]) == {"gsm8k", "mbpp_humaneval"}
    assert s["replay/tasks"]["mbpp_humaneval"]["replay/trace_lines"] == 2
    for over, match in ((["task.shuffle=true"], "task.shuffle=false"), (["replay.trace=x"], "drop replay.trace"),
                        (["target_switch.targets=[tiny_llama2,tiny_llama3]", "target_switch.at=[2]"], "not both")):
        with pytest.raises(OmniDraftError, match=match):
            run(_cfg(tmp_path, "bad", *sw, "engine=replay", *over))


def test_a_replays_speed_is_modelled_again_under_another_machines_calibration(tmp_path):
    """Replay rows record each step's shape (drafter feeds, proposals), so `omnidraft tables
    --speed-machine` models their speed under another machine's calibration: under the run's own it
    gives back the recorded figures, under a machine whose target is twice as slow the plain step
    doubles; a machine without that calibration is one line; rows without shapes stay as they are."""
    from omnidraft.paper_tables import read_runs, remodel_speed, test_rows

    cfg = _cfg(tmp_path, "unused", *PROTOCOL, "engine=replay")
    for c in (cfg, train_stream_config(cfg)):
        t = c.task
        run_trace(_cfg(tmp_path, f"trace_{t.offset}", f"task.offset={t.offset}", f"task.limit={t.limit}", config="trace"))
    run_calibrate(_cfg(tmp_path, "cal", "calibrate.repeats=2", "calibrate.warmup=1", "calibrate.context_tokens=32",
                       "threads=1", config="calibrate"))
    s = run(_cfg(tmp_path, "replay", *PROTOCOL, "engine=replay", "threads=1"))
    (rec,) = read_runs(tmp_path / "replay")
    rows = test_rows(rec)
    assert rows and all(len(r["sd/step_feeds"]) == len(r["sd/step_proposed"]) for r in rows)
    assert any(sum(map(len, r["sd/step_feeds"])) for r in rows)
    keys = ("speed/modelled_sd_s", "speed/modelled_ar_step_s", "speed/modelled_speedup")
    same = remodel_speed(rec, rows, s["replay/calibration_machine"])
    assert [b[k] for b in same for k in keys] == pytest.approx([a[k] for a in rows for k in keys], rel=1e-12)
    own = Path(s["replay/calibration"])
    cal = json.loads(own.read_text())
    for timing in cal["models"]["target"]["forward"].values():
        for k in timing:
            timing[k] *= 2
    cal["machine"] = "slow-target"
    (own.parent / f"slow-target_{own.name.split('_', 1)[1]}").write_text(json.dumps(cal))
    slow = remodel_speed(rec, rows, "slow-target")
    assert rec.speed_machine == "slow-target"
    assert [b["speed/modelled_ar_step_s"] for b in slow] == pytest.approx([2 * a["speed/modelled_ar_step_s"] for a in rows])
    assert all(b["speed/modelled_sd_s"] > a["speed/modelled_sd_s"] for a, b in zip(rows, slow))
    with pytest.raises(OmniDraftError, match=r"--speed-machine=nowhere: no calibration .*omnidraft calibrate"):
        remodel_speed(rec, rows, "nowhere")
    older = [{k: v for k, v in r.items() if k != "sd/step_feeds"} for r in rows]
    assert remodel_speed(rec, older, "slow-target") == older


def test_overlapping_slices_are_refused(tmp_path):
    with pytest.raises(OmniDraftError, match=r"share 2 prompt\(s\).*task.train.offset past the test slice \(>= 3\)"):
        run(_cfg(tmp_path, "r", *PROTOCOL, "task.train.offset=1"))


def test_train_slice_of_another_task(tmp_path):
    cfg = train_stream_config(_cfg(tmp_path, "r", *PROTOCOL, "task=alpaca", "task.limit=2"))
    assert cfg.task.name == "alpaca_sample" and cfg.task.offset == 0 and cfg.task.limit == 4
    assert "task=alpaca_sample" in cfg.overrides and "task=alpaca" not in cfg.overrides


def test_xsum_from_a_local_copy_with_its_own_fields(tmp_path):
    """XSum's own fields (document, summary, id) through task.source=local, first 2 as test and the
    rest as train."""
    f = tmp_path / "xsum.jsonl"
    docs = [{"document": f"Article {i}: the council met on day {i} and voted on the budget.",
             "summary": f"Council votes {i}.", "id": f"bbc-{i}"} for i in range(5)]
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    s = run(_cfg(tmp_path, "x", *PROTOCOL, "task=xsum", "task.source=local", f"task.path={f}", "task.limit=2",
                 "task.train.offset=2", "train_test.train_limit=3", "measure_baseline=false"))
    rows = _rows(tmp_path / "x")
    assert [r["prompt/id"] for r in rows if r["phase"] == "train"] == ["bbc-2", "bbc-3", "bbc-4"]
    assert {r["prompt/id"] for r in rows if r["phase"] == "test"} == {"bbc-0", "bbc-1"}
    assert "quality/rouge1" in s


def _cli(args, cwd):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "omnidraft", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, check=False)


def test_replay_bad_input_is_one_line(tmp_path):
    base = ["engine=replay", "debug=tiny", "task.limit=2", "decode.max_new_tokens=8", "progress=false", "threads=1"]
    one_error_line(_cli([*base, "method.temperature=0.7", "method=spd_dm"], tmp_path),
                   "engine=replay verifies greedily", "method.temperature=0.7")
    one_error_line(_cli([*base, "method=uag_k5"], tmp_path), "transformers' own generation loop", "engine=live")
    one_error_line(_cli(base, tmp_path), "holds none; make it with: omnidraft trace debug=tiny task.limit=2")
    assert _cli(["trace", "debug=tiny", "task.limit=2", "decode.max_new_tokens=8", "progress=false"],
                tmp_path).returncode == 0
    one_error_line(_cli(base, tmp_path), "latency calibration", "omnidraft calibrate debug=tiny threads=1")
    one_error_line(_cli([*base, "task.limit=3"], tmp_path), "lacks 1 of this run's 3 prompts", "2 'synthetic-2'",
                   "make them with: omnidraft trace debug=tiny", "task.limit=3")
    one_error_line(_cli([*base, "decode.max_new_tokens=12"], tmp_path), "at most 8 new tokens")


def test_cut_during_an_evaluation_and_resumed_equals_the_uninterrupted_run(live, tmp_path, monkeypatch):
    """Crash while evaluating after 2 train prompts (the state was saved after train prompt 2),
    resume: the same rows as the uninterrupted run, each evaluation once."""
    from test_runner import run_until_crash

    tmp, _ = live
    over = (*PROTOCOL, "checkpoint_every=1", "threads=1")
    run_until_crash(monkeypatch, _cfg(tmp_path, "cut", *over), at_row=7)  # rows: test@0 x3, train x2, test@2 ...
    s = run(_cfg(tmp_path, "cut", *over, "resume=true"))
    assert s["resumed_at"] == 2
    key = ("phase", "eval/at", "prompt/id", "sd/step_accepted", "text/output", "adapt/loss", "ngram/size")
    a, b = _rows(tmp / "live"), _rows(tmp_path / "cut")
    assert [tuple(r.get(k) for k in key) for r in a] == [tuple(r.get(k) for k in key) for r in b]


def test_train_slice_prompts_take_their_own_tasks_system_prompt(tmp_path):
    """A train slice of another task (alpaca -> alpaca_sample) is prompted as that task is (its own
    system prompt), as its trace was made, not with the test task's."""
    from omnidraft.runner import Session

    cfg = _cfg(tmp_path, "r", *PROTOCOL, "task=alpaca", "task.limit=2", "task.system_prompt=Answer in French.")
    train = train_stream_config(cfg)
    assert train.task.system_prompt is None
    sess = Session(cfg)
    tok = sess.target.tokenizer
    assert "Answer in French." in tok.decode(sess.prompt_ids("Hi", cfg.task))
    assert "Answer in French." not in tok.decode(sess.prompt_ids("Hi", train.task))


def test_a_frozen_method_skips_the_train_stream_and_is_evaluated_once(tmp_path):
    s = run(_cfg(tmp_path, "frozen", *PROTOCOL, "method=spd_dm"))
    rows = _rows(tmp_path / "frozen")
    assert [(r["phase"], r["eval/at"]) for r in rows] == [("test", 0)] * 3  # no train row, one evaluation
    assert s["status"] == "ok" and s["eval/at"] == 0 and "frozen" in s["train/skipped"]
    # an n-gram cache that grows is learning: that method decodes the train stream
    s2 = run(_cfg(tmp_path, "cache", *PROTOCOL, "ablation=cache_pp"))
    assert "train/skipped" not in s2 and s2["eval/at"] == 4


def test_distillspec_distils_on_the_train_slice_then_is_evaluated_frozen(tmp_path):
    """DistillSpec under train_test (no drafter.init_state): the drafter is distilled offline on the
    train slice, into <run_dir>/distill, then served frozen on the test prompts; a re-run reuses the
    distillation; a stream without init_state is still refused."""
    s = run(_cfg(tmp_path, "ds", *PROTOCOL, "row=distillspec"))
    assert s["status"] == "ok" and "distilled offline" in s["train/skipped"]
    d = s["train/distill"]
    assert d["n_prompts"] == 4 and d["distill/n_examples"] >= 1
    assert d["distill/loss_after"] < d["distill/loss_before"]  # it trained
    dsum = json.loads((tmp_path / "ds" / "distill" / "summary.json").read_text())
    assert dsum["task_offset"] == s["train_offset"] and dsum["n_prompts"] == 4  # the train slice, not the test one
    assert (tmp_path / "ds" / "distill" / "state" / "meta.json").exists()
    rows = _rows(tmp_path / "ds")
    assert [r["phase"] for r in rows] == ["test"] * 3
    # the distilled drafter is the one served (the run's recorded config)
    from omegaconf import OmegaConf

    served = OmegaConf.load(tmp_path / "ds" / "config.yaml").drafter.init_state
    assert Path(served) == tmp_path / "ds" / "distill" / "state"
    mtime = (tmp_path / "ds" / "distill" / "state" / "meta.json").stat().st_mtime_ns
    s2 = run(_cfg(tmp_path, "ds", *PROTOCOL, "row=distillspec"))  # the finished distillation is reused
    assert (tmp_path / "ds" / "distill" / "state" / "meta.json").stat().st_mtime_ns == mtime
    assert s2["accept/rate"] == s["accept/rate"]
    with pytest.raises(OmniDraftError, match="serves an offline-distilled drafter"):
        run(_cfg(tmp_path, "stream", "method=distillspec"))


def test_eval_at_start_false_evaluates_after_training_only(tmp_path):
    s = run(_cfg(tmp_path, "late", *PROTOCOL, "train_test.eval_at_start=false"))
    rows = _rows(tmp_path / "late")
    assert sorted({r["eval/at"] for r in rows if r["phase"] == "test"}) == [2, 4] and s["eval/at"] == 4
    assert [d["eval/at"] for d in s["dynamics"]] == [2, 4]
    # a frozen method's one evaluation stays (before the train stream it skips)
    s = run(_cfg(tmp_path, "frozen", *PROTOCOL, "method=spd_dm", "train_test.eval_at_start=false"))
    assert s["eval/at"] == 0 and "frozen" in s["train/skipped"]


@pytest.mark.parametrize("over", [["method=ar"], ["method=pld"], ["method=spd_dm"], ["method=osd"], ["method=omnidraft"],
                                  ["ablation=cache_pp"], ["method=spd_dm", "method.draft_length.policy=heuristic"],
                                  ["method=spd_dm", "method.draft_length.policy=confidence"],
                                  ["method=spd_dm", "method.draft_length.policy=head"], ["method=omnidraft_pl"], ["ablation=heuristic_k"],
                                  ["method=uag"]])
def test_the_config_says_whether_decoding_learns_as_the_built_session_does(tmp_path, over):
    """``omnidraft plan`` counts a run's test evaluations from its config alone
    (:func:`omnidraft.config.decoding_learns`); the runner schedules them from the built session
    (``Session.learns``): the two agree on every kind of method."""
    from omnidraft.config import decoding_learns
    from omnidraft.runner import Session

    cfg = _cfg(tmp_path, "r", *over)
    assert decoding_learns(cfg.method) == Session(cfg).learns()


def test_evaluations_leave_the_train_stream_as_it_is(live, tmp_path):
    """A frozen evaluation changes nothing the drafter learns from: the run evaluated at 0, 2 and 4
    train prompts and one evaluated after training only have the same train rows (steps, tokens,
    losses) and the same final evaluation, so Figure 2's run and Table 1's cell agree where they meet."""
    tmp, _ = live
    run(_cfg(tmp_path, "once", *PROTOCOL, "train_test.eval_every=0", "train_test.eval_at_start=false", "threads=1"))
    every, once = _rows(tmp / "live"), _rows(tmp_path / "once")
    keys = ("prompt/id", "sd/step_proposed", "sd/step_accepted", "sd/new_tokens", "adapt/loss", "ngram/size")

    def part(rows, phase, at=None):
        return [tuple(r.get(k) for k in keys) for r in rows if r["phase"] == phase and (at is None or r.get("eval/at") == at)]

    assert part(every, "train") == part(once, "train") and any(r.get("adapt/loss") for r in once)
    assert part(every, "test", 4) == part(once, "test", 4) and len(part(once, "test")) == 3
