"""kill -9 at random points of a 12-prompt tiny stream (online adaptation on, a checkpoint every 3
prompts), then ``resume=true``: the finished run's rows and state equal an uninterrupted run's,
including where it was killed before its first checkpoint. With the default cadence (a checkpoint
after every prompt) a kill loses at most the prompt being decoded."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnidraft import state as state_io

ARGS = ["debug=tiny", "task=gsm8k", "task.limit=12", "decode.max_new_tokens=8", "progress=false", "logger=none",
        "method.adapt.interval=2", "checkpoint_every=3", "warmup_prompts=0"]
# what a row computes (not how long it took)
KEYS = ("prompt/index", "text/output", "sd/step_proposed", "sd/step_accepted", "sd/new_tokens", "lossless/match",
        "adapt/loss", "ngram/size")


def _cmd(run: Path, *extra: str, args: list[str] = ARGS) -> list[str]:
    return [sys.executable, "-m", "omnidraft", *args, f"hydra.run.dir={run}", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")


def _rows(run: Path) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _state(run: Path) -> tuple[dict, dict]:
    meta = json.loads((run / "state" / "meta.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in ("segments",)}
    return meta, state_io.load(run / "state").tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    proc = subprocess.run(_cmd(run), capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _kill_after(run: Path, n_rows: int, args: list[str] = ARGS) -> None:
    proc = subprocess.Popen(_cmd(run, args=args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n_rows:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the kill point"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("point", random.Random(2026).sample(range(1, 12), 10))
def test_kill_9_then_resume_gives_the_uninterrupted_rows_and_state(tmp_path, reference, point):
    run = tmp_path / "run"
    _kill_after(run, point)
    proc = subprocess.run(_cmd(run, "resume=true"), capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(run) == _rows(reference)
    meta, tensors = _state(run)
    ref_meta, ref_tensors = _state(reference)
    assert meta == ref_meta
    assert tensors.keys() == ref_tensors.keys()
    assert all((tensors[k] == ref_tensors[k]).all() for k in tensors)
    assert not (run / "state.new").exists()


def _same_state(run: Path, reference: Path) -> None:
    meta, tensors = _state(run)
    ref_meta, ref_tensors = _state(reference)
    assert meta == ref_meta
    assert tensors.keys() == ref_tensors.keys()
    assert all((tensors[k] == ref_tensors[k]).all() for k in tensors)


@pytest.mark.parametrize("point", [1, 6])
def test_with_the_default_cadence_a_kill_loses_at_most_the_prompt_in_flight(tmp_path, reference, point):
    run = tmp_path / "run"
    every_prompt = [a for a in ARGS if not a.startswith("checkpoint_every=")]
    _kill_after(run, point, args=every_prompt)
    logged = len((run / "metrics.jsonl").read_text().splitlines())
    meta = run / "state" / "meta.json"
    saved = json.loads(meta.read_text())["next_index"] if meta.exists() else 0  # killed before the first one
    assert logged - 1 <= saved <= logged, (logged, saved)  # killed before its checkpoint, or after it
    proc = subprocess.run(_cmd(run, "resume=true", args=every_prompt), capture_output=True, text=True, env=_env(),
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(run) == _rows(reference)  # the cadence changes nothing the run computes
    _same_state(run, reference)
    assert not (run / "state.new").exists()
