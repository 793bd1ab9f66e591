"""``omnidraft calibrate`` on tiny models: the file holds every n with sane timings, the reader
interpolates linearly between measured n, the modelled speedup is the tables' formula, and bad input
is one clear line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF_DIR, one_error_line
from hydra import compose, initialize_config_dir

from omnidraft.calibrate import (
    Calibration,
    ModelLatency,
    StepShape,
    Timing,
    calibration_path,
    check_calibrate_config,
    check_calibration,
    load_calibration,
    machine_slug,
    modelled_speedup,
    run_calibrate,
    step_seconds,
)
from omnidraft.config import register_configs
from omnidraft.errors import OmniDraftError
from omnidraft.tables import summarise

NS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24]  # the default calibrate.tokens_per_forward
FAST = ["debug=tiny", "calibrate.repeats=3", "calibrate.warmup=1", "calibrate.context_tokens=64", "threads=1",
        "progress=false"]


def _cfg(tmp_path, *over):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("calibrate", overrides=[f"run_dir={tmp_path}/run", f"calibrate.out={tmp_path}/cal.json",
                                               *FAST, *over])


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibrate")
    summary = run_calibrate(_cfg(tmp))
    return tmp, summary


def test_the_file_holds_every_n_with_ordered_timings(calibrated):
    tmp, s = calibrated
    assert s["status"] == "ok" and s["calibration"] == str(tmp / "cal.json")
    obj = json.loads((tmp / "cal.json").read_text())
    assert obj["format"] == 1 and obj["tokens_per_forward"] == NS
    assert obj["context_tokens"] == 64 and obj["repeats"] == 3 and obj["warmup"] == 1
    m = obj["models"]
    assert (m["target"]["name"], m["drafter"]["name"]) == ("tiny_qwen2", "tiny_llama2")
    for role, tables in (("target", ["forward"]), ("drafter", ["forward", "forward_hidden"])):
        e = m[role]
        assert e["dtype"] == "float32" and e["device"] == "cpu" and e["threads"] == 1
        assert sorted(k for k in e if k.startswith("forward")) == tables
        for tab in tables:
            assert sorted(map(int, e[tab])) == NS
            for x in e[tab].values():
                assert 0 < x["min_s"] <= x["median_s"] <= x["max_s"]
    prov = obj["provenance"]
    for k in ("git_hash", "versions", "cpu", "cpu_capability", "cpu_flags", "gpu", "torch_threads"):
        assert k in prov, k
    assert prov["torch_threads"] == 1
    md = (tmp / "cal.md").read_text()
    assert md.count("\n| ") == len(NS) + 1 and "tiny_qwen2" in md  # header + one row per n
    # the run directory (RunContext): one metrics row per model table and n
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * len(NS)
    assert json.loads((tmp / "run" / "summary.json").read_text())["status"] == "ok"


def test_the_reader_is_exact_at_measured_n_and_linear_between(calibrated):
    tmp, _ = calibrated
    cal = load_calibration(tmp / "cal.json")
    obj = json.loads((tmp / "cal.json").read_text())["models"]
    for n in NS:
        assert cal.target_s(n) == obj["target"]["forward"][str(n)]["median_s"]
        assert cal.drafter_s(n) == obj["drafter"]["forward"][str(n)]["median_s"]
        assert cal.drafter_s(n, hidden=True) == obj["drafter"]["forward_hidden"][str(n)]["median_s"]
    a, b = cal.target_s(8), cal.target_s(12)
    assert cal.target_s(10) == pytest.approx((a + b) / 2)
    assert cal.target_s(9) == pytest.approx(a + (b - a) / 4)
    with pytest.raises(OmniDraftError, match="n=25 tokens is beyond the largest calibrated n=24"):
        cal.target_s(25)
    with pytest.raises(OmniDraftError, match="below the smallest"):
        cal.drafter_s(0)


def _hand_made() -> Calibration:
    def lat(name, table, hidden=None):
        tabs = {"forward": {n: Timing(s, s * 0.9, s * 1.2) for n, s in table.items()}}
        if hidden is not None:
            tabs["forward_hidden"] = {n: Timing(s, s, s) for n, s in hidden.items()}
        return ModelLatency(name, "float32", "cpu", 4, tabs)

    return Calibration(target=lat("t", {1: 0.010, 2: 0.011, 4: 0.014, 8: 0.022}),
                       drafter=lat("d", {1: 0.002, 2: 0.0024, 4: 0.003}, {1: 0.0025, 2: 0.003, 4: 0.0035}),
                       context_tokens=256, repeats=7)


def test_interpolation_on_a_hand_made_table():
    cal = _hand_made()
    assert cal.target_s(4) == 0.014 and cal.target_s(8) == 0.022
    assert cal.target_s(3) == pytest.approx(0.0125)
    assert cal.target_s(6) == pytest.approx(0.018)
    assert cal.drafter_s(3, hidden=True) == pytest.approx(0.00325)
    with pytest.raises(OmniDraftError, match="beyond the largest calibrated n=4"):
        cal.drafter_s(5)
    cal.extrapolate = True  # a replay: longer forwards scale the largest n's time
    assert cal.drafter_s(6) == pytest.approx(0.003 * 6 / 4) and cal.target_s(16) == pytest.approx(0.044)
    with pytest.raises(OmniDraftError, match="below the smallest"):
        cal.target_s(0)


def test_modelled_speedup_is_the_tables_figure():
    """Rows whose measured step times are the calibration's: summarise's figure and the
    calibration's are the same number (one formula)."""
    cal = _hand_made()
    prompts = [  # (steps, new tokens) per prompt
        ([StepShape(4, (2, 1, 1)), StepShape(6, (1, 1, 1, 1, 1)), StepShape(1)], 9),
        ([StepShape(3, (1, 1), hidden=True), StepShape(8, (4, 1, 1, 1, 1, 1, 1), hidden=True)], 7),
    ]
    rows = []
    for steps, new in prompts:
        draft = sum(sum(cal.drafter_s(n, s.hidden) for n in s.drafter_tokens) for s in steps)
        target = sum(cal.target_s(s.target_tokens) for s in steps)
        assert draft + target == pytest.approx(sum(step_seconds(cal, s) for s in steps))
        rows.append({"sd/new_tokens": new, "sd/steps": len(steps), "sd/proposed": 10, "sd/accepted": 5,
                     "sd/wall_s": 1.0, "sd/draft_s": draft, "sd/target_s": target,
                     "ar/new_tokens": new, "ar/steps": new, "ar/target_s": new * cal.target_s(1), "ar/wall_s": 1.0,
                     "lossless/match": True})
    want = summarise(rows, greedy=True)["speed/modelled_speedup"]
    all_steps = [s for steps, _ in prompts for s in steps]
    got = modelled_speedup(cal, all_steps, sum(new for _, new in prompts))
    assert got == pytest.approx(want, rel=1e-12) and got > 0
    assert modelled_speedup(cal, [], 0) == 0.0


def test_check_calibration_refuses_another_pair_or_dtype(calibrated, tmp_path):
    cal = load_calibration(calibrated[0] / "cal.json")
    check_calibration(cal, "tiny_qwen2", "tiny_llama2", "float32")
    check_calibration(cal, "tiny_qwen2", "tiny_llama2", "float32", drafter_dtype="float32")
    with pytest.raises(OmniDraftError, match="is of target 'tiny_qwen2', this run's target is 'other'.*"
                                             "omnidraft calibrate target=other drafter=tiny_llama2"):
        check_calibration(cal, "other", "tiny_llama2", "float32")
    with pytest.raises(OmniDraftError, match="is of drafter 'tiny_llama2', this run's drafter is 'x'"):
        check_calibration(cal, "tiny_qwen2", "x", "float32")
    with pytest.raises(OmniDraftError, match="timed the target in float32, this run's target runs bfloat16"):
        check_calibration(cal, "tiny_qwen2", "tiny_llama2", "bfloat16")
    with pytest.raises(OmniDraftError, match="timed the drafter in float32, this run's drafter runs float16"):
        check_calibration(cal, "tiny_qwen2", "tiny_llama2", "float32", drafter_dtype="float16")
    with pytest.raises(OmniDraftError, match="no latency calibration at .*nothing.json.*omnidraft calibrate"):
        load_calibration(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text('{"format": 1')
    with pytest.raises(OmniDraftError, match="unreadable latency calibration"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": 1, "kind": "something else"}')
    with pytest.raises(OmniDraftError, match="not a format-1 latency calibration"):
        load_calibration(tmp_path / "other.json")


@pytest.mark.parametrize("over, needle", [
    (["calibrate.tokens_per_forward=[0,2]"], "every value must be an integer >= 1 (bad: 0)"),
    (["calibrate.tokens_per_forward=[]"], "calibrate.tokens_per_forward is empty"),
    (["calibrate.repeats=0"], "calibrate.repeats=0 must be >= 1"),
    (["calibrate.warmup=-1"], "calibrate.warmup=-1 must be >= 0"),
])
def test_bad_settings_are_refused_before_loading(tmp_path, over, needle):
    with pytest.raises(OmniDraftError, match=re.escape(needle)):
        check_calibrate_config(_cfg(tmp_path, *over))


def test_no_drafter_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.drafter = None  # e.g. what method=ar sets, where no debug=tiny puts the drafter back
    with pytest.raises(OmniDraftError, match="this config has no drafter"):
        check_calibrate_config(cfg)


def test_a_context_too_long_for_a_model_is_refused(tmp_path):
    with pytest.raises(OmniDraftError, match="need 2072 positions, the target tiny_qwen2 has 2048"):
        run_calibrate(_cfg(tmp_path, "calibrate.context_tokens=2048"))


def test_default_path_names_pair_machine_dtype_threads(tmp_path):
    cfg = _cfg(tmp_path, "calibrate.out=null")
    assert calibration_path(cfg, "amd-epyc", 8) == \
        Path("results/calibration/tiny_qwen2-tiny_llama2/amd-epyc_float32_8t.json")
    cfg.drafter.dtype = "bfloat16"
    assert calibration_path(cfg, "m", 1).name == "m_float32-bfloat16_1t.json"
    assert machine_slug("cpu", "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == "intel-xeon-platinum-8480"
    assert machine_slug("cpu", "AMD EPYC 9654 96-Core Processor") == "amd-epyc-9654-96-core-processor"
    assert machine_slug("cpu", None) == "cpu"
    # one CPU name has landed as an AVX2-only and as an AMX machine: the ISA tells them apart
    assert machine_slug("cpu", "Intel(R) Xeon(R) Processor", {"avx2", "avx512f", "amx_bf16"}) == "intel-xeon-processor-amx"
    assert machine_slug("cpu", "Intel(R) Xeon(R) Processor", {"avx2", "fma"}) == "intel-xeon-processor-avx2"
    assert machine_slug("cpu", "AMD EPYC", {"avx2", "avx512f", "avx512_bf16"}) == "amd-epyc-avx512bf16"


def _cli(args, cwd):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "omnidraft", "calibrate", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300, check=False)


def test_cli_writes_the_default_layout_and_refuses_in_one_line(tmp_path):
    proc = _cli([*FAST, "calibrate.tokens_per_forward=[1,4]"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = tmp_path / "results" / "calibration" / "tiny_qwen2-tiny_llama2"
    files = sorted(p.name for p in d.glob("*_float32_1t.*"))
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".md"), files
    cal = load_calibration(d / files[0])
    assert sorted(cal.target.tables["forward"]) == [1, 4] and cal.target.threads == 1
    runs = list((d / "runs").iterdir())
    assert len(runs) == 1
    for f in ("config.yaml", "provenance.json", "metrics.jsonl", "summary.json"):
        assert (runs[0] / f).exists(), f
    one_error_line(_cli(["debug=tiny", "calibrate.tokens_per_forward=[1,-2]"], tmp_path),
                   "calibrate.tokens_per_forward", "bad: -2")
    one_error_line(_cli(["debug=tiny", "calibrate.repeats=0"], tmp_path), "calibrate.repeats=0")


def test_replay_can_time_the_target_in_another_dtype_than_its_trace(calibrated, tmp_path):
    """replay.speed_target_dtype: acceptance from a float32 trace, speed from a bfloat16 calibration
    (what the bench runs); the calibration must then be of that dtype."""
    from omnidraft.replay import machine_calibration

    obj = json.loads((calibrated[0] / "cal.json").read_text())
    obj["models"]["target"]["dtype"] = "bfloat16"
    bf16 = tmp_path / "bf16.json"
    bf16.write_text(json.dumps(obj))
    cfg = _cfg(tmp_path, f"replay.calibration={bf16}")
    with pytest.raises(OmniDraftError, match="timed the target in bfloat16, this run's target runs float32"):
        machine_calibration(cfg, True, "engine=replay models speed from")
    cfg.replay.speed_target_dtype = "bfloat16"
    assert machine_calibration(cfg, True, "engine=replay models speed from").target.dtype == "bfloat16"
    assert cfg.target.dtype == "float32"  # the run itself is untouched
    cfg.replay.calibration = str(calibrated[0] / "cal.json")  # a float32 one no longer fits
    with pytest.raises(OmniDraftError, match="timed the target in float32, this run's target runs bfloat16"):
        machine_calibration(cfg, True, "engine=replay models speed from")
