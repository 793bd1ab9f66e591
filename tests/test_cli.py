"""The command line: bad input gives one clear line and a non-zero exit, never a traceback;
``omnidraft debug=tiny`` writes the three run files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_error_line

ROOT = Path(__file__).resolve().parent.parent


def _cli(args, tmp_path, env_extra=None, timeout=300):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "omnidraft", f"hydra.run.dir={tmp_path}/run", *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout)


def test_debug_tiny_writes_run_files(tmp_path):
    proc = _cli(["debug=tiny"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (run / f).exists(), f
    s = json.loads((run / "summary.json").read_text())
    assert s["n_prompts"] == 4 and s["lossless/match_rate"] == 1.0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    assert s["provenance"]["overrides"] == ["debug=tiny"]
    assert s["choices"]["debug"] == "tiny" and s["choices"]["target"] == "tiny_qwen2"


@pytest.mark.parametrize("args,needles", [
    (["debug=tiny", "foo=1"], ["foo"]),
    (["debug=tiny", "method.kk=3"], ["kk"]),
    (["target=nope"], ["nope", "gemma3_270m, ", ", tiny_qwen2"]),  # every option of the group, on the one line
    (["debug=tiny", "hydra.launcher.n_jobz=2"], ["hydra.launcher.n_jobz"]),  # Hydra's own config is checked too
    (["debug=tiny", "hydra/launcher=nope"], ["hydra/launcher/nope", "joblib, ", "submitit_local"]),
    (["debug=tiny", "seed=0,x", "-m"], ["seed=x", "Integer"]),
    (["-m", "debug=tiny"], ["unrecognized arguments: debug=tiny", "before or after all of them"]),  # after run.dir=  # a later seed too, before seed 0's job starts
    (["debug=tiny", "-m", "--info"], ["--info and --multirun", "one of them"]),
    (["debug=tiny", "--cfg", "jb"], ["argument --cfg/-c: invalid choice: 'jb'", "'job'", "--help"]),  # Hydra's flags
    (["debug=tiny", "--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    (["distill", "debug=tiny", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["experiment=paper/table6_t1", "scale=tiny"], ["experiment=paper/table6_t1 is a sweep", "method.temperature", "add -m"]),
    (["experiment=paper/nope"], ["experiment/paper/nope", "paper/table1, "]),  # a nested group: the experiments
    (["debug=tiny", "method.k=0"], ["method.k=0"]),
    (["debug=tiny", "method=omnidraft", "method.drafter.eviction=lfuu"], ["method.drafter: eviction must be 'lru' or 'lfu', got 'lfuu'"]),
    (["debug=tiny", "method=omnidraft", "method.drafter.capacity=0"], ["method.drafter: capacity must be >= 1", "got 0"]),
    (["debug=tiny", "ablation=adaptive_joint", "method.draft_length.gamma_infer=0.5"], ["gamma_infer", "head_learn=false"]),
])
def test_bad_overrides(tmp_path, args, needles):
    one_error_line(_cli(args, tmp_path), *needles)


def test_the_ray_launcher_without_its_extra_names_the_extra(tmp_path):
    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None:
        pytest.skip("the optional extra .[ray] is installed here")
    one_error_line(_cli(["debug=tiny", "hydra/launcher=ray_cpu"], tmp_path), "hydra/launcher/ray", "pip install -e '.[ray]'")


@pytest.mark.parametrize("args,needles", [
    (["tables"], ["tables: the following arguments are required: group", "--help"]),
    (["tables", "results", "--overveiw"], ["unrecognized arguments: --overveiw"]),
    (["plan", "experiment=paper/table1", "scale=tiny", "--out={tmp}/plan.md/sub.md"], ["--out=", "plan.md/sub.md"]),
    (["plan", "experiment=paper/table1", "scale=tiny", "--out={tmp}"], ["--out=", "a directory"]),
    (["plan", "experiment=paper/tabel1"], ["experiment/paper/tabel1", "paper/table1, "]),
])
def test_the_subcommands_bad_input(tmp_path, args, needles):
    (tmp_path / "plan.md").write_text("a file where --out wants a directory")
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "omnidraft", *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2
    one_error_line(proc, *needles)
    assert not list(tmp_path.glob("plan*.json"))  # failed before any work: nothing written


def test_gguf_checksum_mismatch(tmp_path):
    bad = "0" * 64
    proc = _cli(["debug=tiny", "drafter=smollm2_135m", f"drafter.gguf.sha256={bad}"], tmp_path)
    one_error_line(proc, "checksum mismatch", bad)


def test_hub_id_while_offline(tmp_path):
    proc = _cli(["debug=tiny", "drafter=llama_68m"], tmp_path, {"HF_HUB_OFFLINE": "1"})
    one_error_line(proc, "JackFram/llama-68m", "path=")


def test_prompt_longer_than_context(tmp_path):
    proc = _cli(["debug=tiny", "target.max_context=40"], tmp_path)
    one_error_line(proc, "context of 40", "decode.max_new_tokens")


@pytest.mark.parametrize("args,needles", [
    (["distill", "debug=tiny", "distill.divergence=kl"], ["distill.divergence=", "fkl"]),
    (["distill", "debug=tiny", "distill.data=teacher"], ["teacher"]),
    (["bench", "debug=tiny", "bench.methods=[ar,nope]"], ["nope"]),
    (["bench", "debug=tiny", "bench.methods=[spd_dm]"], ["must include ar"]),
    (["bench", "debug=tiny", "engine=replay"], ["omnidraft bench decodes live", "drop engine="]),
    (["distill", "debug=tiny", "protocol=train_test"], ["omnidraft distill has its own protocol"]),
    (["debug=tiny", "engine=replays"], ["engine='replays'", "live, replay"]),
    (["debug=tiny", "protocol=train"], ["protocol='train'", "stream, train_test"]),
    (["debug=tiny", "method=distillspec"], ["omnidraft distill"]),
    (["bench", "debug=tiny"], ["bench method 'distillspec'", "omnidraft distill"]),
    (["bench", "debug=tiny", "bench.method_overrides.spd_dm=['target=tiny_llama3']"], ["shared by every method"]),
    (["debug=tiny", "method.adapt.positions=accepted"], ["method.adapt.positions='accepted'"]),
    (["debug=tiny", "method=uag", "method.hf.num_assistant_tokens_schedule=heuristc"], ["heuristc"]),
])
def test_subcommand_bad_input(tmp_path, args, needles):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "omnidraft", *args, f"hydra.run.dir={tmp_path}/run"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    one_error_line(proc, *needles)


def test_sigterm_keeps_what_was_computed(tmp_path):
    """kill (or SLURM's time limit) mid-stream: one error line, and summary.json holds the prompts
    finished so far."""
    import signal
    import time

    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.Popen([sys.executable, "-m", "omnidraft", "debug=tiny", "task.limit=200", "logger=none", "progress=false",
                             f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("omnidraft: error:")] == \
        ["omnidraft: error: interrupted; the run directory's metrics.jsonl and summary (bench: results JSON) "
         "hold the prompts finished so far"]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"].startswith("failed: KeyboardInterrupt") and s["n_prompts"] >= 2
    assert s["n_prompts"] == len(metrics.read_text().splitlines())
