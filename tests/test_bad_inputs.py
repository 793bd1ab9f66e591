"""The bad-input catalogue: every case a new user might try ends in ONE ``omnidraft: error:`` line that
names the bad value and the fix, exit code 2, no traceback, and nothing already computed is lost
(a resumed run's earlier rows and checkpoint stay as they were; a failed checkpoint leaves the
previous one intact and no half-written ``state.new``).

Each case runs the real CLI in a subprocess on the tiny models (real tokenizers), warnings off, so
stderr must be exactly the one line. The checkpoint cases fill the "disk" with RLIMIT_FSIZE: the
write fails with EFBIG the way a full disk fails with ENOSPC.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = ["debug=tiny", "task.limit=2", "decode.max_new_tokens=8", "progress=false", "logger=none"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no API key
    env.update(HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    return env


def _fsize_limit(nbytes: int):
    def apply() -> None:  # in the child: a write past nbytes fails with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def _omnidraft(args: list[str], cwd: Path, run_dir: Path | None, preexec=None) -> subprocess.CompletedProcess:
    sub = [args.pop(0)] if args and args[0] in ("bench", "distill", "trace", "calibrate", "tables") else []
    has_dir = any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args)
    multirun = "-m" in args
    where = [] if has_dir or sub == ["tables"] or run_dir is None else \
        [f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"]
    base = [] if sub == ["tables"] else TINY
    return subprocess.run([sys.executable, "-m", "omnidraft", *sub, *base, *where, *args], capture_output=True,
                          text=True, cwd=cwd, env=_env(), timeout=600, preexec_fn=preexec)


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name in ("metrics.jsonl", "meta.json", "rows.jsonl",
                                                                         "tensors.safetensors", "weights.safetensors")}


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory) -> Path:
    """A finished tiny run that adapted online (interval 1) and checkpointed: what resume reads."""
    d = tmp_path_factory.mktemp("ref")
    proc = _omnidraft(["method.adapt.interval=1"], d, d / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (d / "run" / "state" / "meta.json").is_file()
    return d / "run"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("files")
    (d / "empty.jsonl").write_text("")
    (d / "latin1.jsonl").write_bytes('{"question": "caf\xe9?", "answer": "1"}\n'.encode("latin-1"))
    (d / "garbage.jsonl").write_text('{"question": "a?", "answer": "1"}\nnot json\n')
    (d / "he.jsonl").write_text(json.dumps({"task_id": "x/0", "prompt": "def f():\n", "test": "assert True",
                                            "canonical_solution": "    return 1\n"}) + "\n")
    (d / "a_file").write_text("x")
    return d


def _meta_garbage(state: Path) -> None:
    (state / "meta.json").write_text("{not json")


def _meta_empty(state: Path) -> None:
    (state / "meta.json").write_text("")


def _tensors_cut(state: Path) -> None:
    f = state / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _weights_cut(state: Path) -> None:
    f = state / "weights.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _rows_garbage(state: Path) -> None:
    with open(state / "rows.jsonl", "a") as f:
        f.write("garbage\n")


DAMAGE = {"meta_garbage": _meta_garbage, "meta_empty": _meta_empty, "tensors_cut": _tensors_cut,
          "weights_cut": _weights_cut,
          "rows_garbage": _rows_garbage}

# (case id, overrides, words the error line must contain). {files} is the fixture's directory.
CONFIG_CASES = [
    ("plus_unknown_key", ["+foo=1"], ["+foo", "'foo'"]),
    ("plus_typo_nested", ["+method.adapt.lrr=1"], ["method.adapt.lrr", "did you mean method.adapt.lr"]),
    ("unknown_key", ["foo=1"], ["foo"]),
    ("temperature_negative", ["method.temperature=-1"], ["method.temperature=-1.0", ">= 0"]),
    ("temperature_nan", ["method.temperature=nan"], ["method.temperature=nan", "finite"]),
    ("temperature_inf", ["method.temperature=inf"], ["method.temperature=inf", "finite"]),
    ("lr_nan", ["method.adapt.lr=nan"], ["method.adapt.lr=nan", "finite"]),
    ("lr_inf", ["method.adapt.lr=inf"], ["method.adapt.lr=inf", "finite"]),
    ("lr_negative", ["method.adapt.lr=-1e-4"], ["method.adapt.lr=-0.0001", ">= 0"]),
    ("interval_zero", ["method.adapt.interval=0"], ["method.adapt.interval=0", ">= 1"]),
    ("interval_negative", ["method.adapt.interval=-1"], ["method.adapt.interval=-1"]),
    ("batch_size_zero", ["method.adapt.batch_size=0"], ["method.adapt.batch_size=0"]),
    ("steps_per_update_zero", ["method.adapt.steps_per_update=0"], ["method.adapt.steps_per_update=0"]),
    ("lam_negative", ["method.adapt.lam=-0.5"], ["method.adapt.lam=-0.5"]),
    ("threads_negative", ["threads=-1"], ["threads=-1", "or null"]),
    ("threads_zero", ["threads=0"], ["threads=0"]),
    ("limit_zero", ["task.limit=0"], ["task.limit=0"]),
    ("limit_negative", ["task.limit=-1"], ["task.limit=-1"]),
    ("offset_negative", ["task.offset=-3"], ["task.offset=-3", ">= 0"]),
    ("k_zero", ["method.k=0"], ["method.k=0"]),
    ("max_new_tokens_zero", ["decode.max_new_tokens=0"], ["decode.max_new_tokens=0"]),
    ("max_new_tokens_text", ["decode.max_new_tokens=abc"], ["decode.max_new_tokens=abc"]),
    ("seed_text", ["seed=abc"], ["seed=abc"]),
    ("baseline_every_zero", ["baseline_every=0"], ["baseline_every=0"]),
    ("checkpoint_every_negative", ["checkpoint_every=-1"], ["checkpoint_every=-1"]),
    ("exec_timeout_zero", ["task.exec_timeout_s=0"], ["task.exec_timeout_s=0"]),
    ("method_unknown", ["method=nope"], ["method/nope"]),
    ("target_unknown", ["target=nope"], ["target/nope"]),
    ("sweep_bad_value", ["method.k=1,abc", "-m"], ["method.k=abc"]),  # the flag after every override, as Hydra needs
    ("sweep_bad_group", ["method=nope,omnidraft", "-m"], ["method/nope"]),
    ("length_policy_unknown", ["method.draft_length.policy=bogus"], ["policy='bogus'", "fixed"]),
    ("replay_with_sampling", ["engine=replay", "method.temperature=0.7"], ["engine=replay", "method.temperature=0"]),
    ("device_not_a_device", ["target.device=tpu"], ["target.device='tpu'", "auto, cpu, cuda"]),
    ("dtype_unknown", ["target.dtype=float7"], ["float7", "float32"]),
    ("run_dir_in_proc", ["hydra.run.dir=/proc/omnidraft_x"], ["hydra.run.dir=/proc/omnidraft_x", "writable"]),
    ("run_dir_under_a_file", ["hydra.run.dir={files}/a_file/run"], ["a_file/run", "Not a directory"]),
    ("calibrate_repeats_zero", ["calibrate", "calibrate.repeats=0"], ["calibrate.repeats=0"]),
    ("tables_missing_dir", ["tables", "{files}/no_such_dir"], ["no_such_dir", "not a directory"]),
    ("tables_speed_machine_of_a_group", ["tables", "core", "--speed-machine=amd-epyc-avx2"],
     ["--speed-machine=amd-epyc-avx2", "paper tables"]),
]
LOAD_CASES = [  # these load the tiny models first
    ("wandb_online_without_key", ["logger=wandb_online"], ["wandb", "wandb login"]),
    ("local_file_missing", ["task=gsm8k", "task.source=local", "task.path={files}/missing.jsonl"], ["missing.jsonl"]),
    ("local_file_empty", ["task=gsm8k", "task.source=local", "task.path={files}/empty.jsonl"], ["empty.jsonl", "empty"]),
    ("local_file_not_utf8", ["task=gsm8k", "task.source=local", "task.path={files}/latin1.jsonl"],
     ["latin1.jsonl:1", "UTF-8"]),
    ("local_file_garbage_line", ["task=gsm8k", "task.source=local", "task.path={files}/garbage.jsonl"],
     ["garbage.jsonl:2", "on_bad_record=skip"]),
    ("humaneval_record_without_entry_point", ["task=humaneval", "task.source=local", "task.path={files}/he.jsonl",
                                              "task.execute_code=true"], ["he.jsonl:1", "entry_point"]),
    ("offset_past_the_end", ["task.offset=100000"], ["task.offset=100000", "past the end"]),
    ("init_state_missing", ["drafter.init_state={files}/no_state"], ["no_state", "init_state"]),
]
if not torch.cuda.is_available():
    CONFIG_CASES.append(("device_cuda_without_cuda", ["target.device=cuda"], ["target.device=cuda", "CUDA"]))


def _one_line(proc: subprocess.CompletedProcess, needles: list[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("omnidraft: error: "), proc.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case,args,needles", CONFIG_CASES + LOAD_CASES, ids=[c[0] for c in CONFIG_CASES + LOAD_CASES])
def test_bad_input_ends_in_one_line(tmp_path, files, case, args, needles):
    args = [a.replace("{files}", str(files)) for a in args]
    _one_line(_omnidraft(args, tmp_path, tmp_path / "run"), needles)


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("how", ["resume", "init_state"])
def test_a_damaged_state_ends_in_one_line_and_keeps_the_rows(tmp_path, ref_run, damage, how):
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    DAMAGE[damage](run / "state")
    before = _digest(run)
    if how == "resume":
        args = ["method.adapt.interval=1", "resume=true", "task.limit=3"]
        proc = _omnidraft(args, tmp_path, run)
    else:
        proc = _omnidraft([f"drafter.init_state={run / 'state'}", "task.offset=4"], tmp_path, tmp_path / "other")
    _one_line(proc, [str(run / "state"), "damaged"])
    assert _digest(run) == before  # the rows and the (damaged) checkpoint are left for the user to repair


def test_a_full_disk_at_the_first_checkpoint_keeps_the_rows_and_leaves_no_half_state(tmp_path):
    run = tmp_path / "run"
    # the tiny state is ~25 MB; one checkpoint, at the end (the default is one after every prompt)
    proc = _omnidraft(["checkpoint_every=0"], tmp_path, run, preexec=_fsize_limit(4_000_000))
    _one_line(proc, ["could not write the online state", "no earlier checkpoint"])
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # both prompts' rows kept
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"].startswith("failed") and summary["n_prompts"] == 2
    assert not (run / "state.new").exists() and not (run / "state").exists()


def test_a_full_disk_at_a_later_checkpoint_keeps_the_previous_one(tmp_path):
    import time

    run = tmp_path / "run"
    args = ["method.adapt.interval=1", "checkpoint_every=1", "task.limit=4"]
    cmd = [sys.executable, "-m", "omnidraft", *TINY, f"hydra.run.dir={run}", *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "state" / "meta.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()  # SIGKILL right after the first checkpoint
    proc.wait()
    saved = json.loads((run / "state" / "meta.json").read_text())
    assert saved["next_index"] < 4, "the run finished before it was killed"
    state_before = {k: v for k, v in _digest(run).items() if k.startswith("state/")}
    res = _omnidraft([*args, "resume=true"], tmp_path, run, preexec=_fsize_limit(4_000_000))
    _one_line(res, ["could not write the online state", "previous checkpoint", "intact", "resume=true"])
    assert {k: v for k, v in _digest(run).items() if k.startswith("state/")} == state_before
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == saved["next_index"] + 1  # the prompt decoded after the resume keeps its row
    assert not (run / "state.new").exists()


def test_a_learning_rate_that_diverges_skips_the_update_and_never_writes_a_non_finite_state(tmp_path):
    from omnidraft import state as state_io

    run = tmp_path / "run"
    proc = _omnidraft(["method.adapt.lr=1e308", "method.adapt.interval=1", "task.limit=3"], tmp_path, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("adapt/reverted") for r in rows] == [1, 1, 1]  # every update diverged and was undone
    tensors = state_io.load(run / "state").tensors
    assert any(k.startswith("param.") for k in tensors)
    assert all(torch.isfinite(v).all() for v in tensors.values() if v.is_floating_point())
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


def test_adding_a_config_group_or_into_an_open_mapping_stays_allowed():
    from hydra import compose, initialize_config_dir

    from omnidraft.cli import _check_added_keys
    from omnidraft.config import CONF_DIR, register_configs
    from omnidraft.errors import OmniDraftError

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        _check_added_keys(["+bench_suite=adaptive"], compose, "bench")  # a group append
        _check_added_keys(["+bench.variants.x={method:pld}", "+method.drafter.capacity=8"], compose, "bench")
        with pytest.raises(OmniDraftError, match="did you mean bench.limit"):
            _check_added_keys(["+bench.limt=3"], compose, "bench")
