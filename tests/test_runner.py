"""run(cfg) on tiny models: the summary's keys and what they must mean."""

from __future__ import annotations

import json

from conftest import CONF_DIR
from hydra import compose, initialize_config_dir

from omnidraft.config import register_configs
from omnidraft.runner import run


def _cfg(tmp_path, *over):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"run_dir={tmp_path}", "debug=tiny", *over])


def test_run_summary(tmp_path):
    s = run(_cfg(tmp_path, "task.limit=3", "decode.max_new_tokens=16", "method.k=3"))
    for key in ("accept/rate", "accept/mean_len", "speed/ar_tok_per_s", "speed/sd_tok_per_s",
                "speed/speedup", "speed/modelled_speedup", "lossless/match_rate", "n_prompts", "provenance"):
        assert key in s, key
    assert s["n_prompts"] == 3 and s["lossless/match_rate"] == 1.0
    assert s["accept/mean_len"] >= 1.0
    prov = s["provenance"]
    for key in ("git_hash", "git_dirty", "versions", "cpu", "torch_threads", "seed", "overrides"):
        assert key in prov
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # summary ratios are ratios of totals over the per-prompt rows
    acc = sum(r["sd/accepted"] for r in rows) / sum(r["sd/proposed"] for r in rows)
    assert abs(acc - s["accept/rate"]) < 1e-12
    assert all(r["sd/new_tokens"] <= 16 for r in rows)
    assert json.loads((tmp_path / "summary.json").read_text())["n_prompts"] == 3
    # written when the run started, so a run killed before its summary keeps it
    assert json.loads((tmp_path / "provenance.json").read_text())["git_hash"] == prov["git_hash"]


def test_ar_method_and_baseline_every(tmp_path):
    s = run(_cfg(tmp_path / "a", "method=ar", "task.limit=2", "decode.max_new_tokens=8"))
    assert s["n_prompts"] == 2 and s["accept/rate"] == 0.0 and s["accept/mean_len"] == 1.0
    s = run(_cfg(tmp_path / "b", "task.limit=4", "baseline_every=2", "decode.max_new_tokens=8"))
    assert s["n_baseline_prompts"] == 2


def test_seeded_sampling_run_reproduces(tmp_path):
    over = ("method=spd_dm", "task.limit=2", "decode.max_new_tokens=12", "method.temperature=1.0",
            "measure_baseline=false")
    run(_cfg(tmp_path / "a", *over))
    run(_cfg(tmp_path / "b", *over))
    out = lambda d: [json.loads(x)["text/output"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert out("a") == out("b")


def test_default_logger_writes_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    s = run(_cfg(tmp_path, "logger=default", "task.limit=1", "decode.max_new_tokens=4"))
    assert s["n_prompts"] == 1
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_python_api_generates_text():
    from omnidraft.api import load

    dec = load(overrides=["debug=tiny", "method.k=3"])
    out = dec.generate_text("Hello there", with_baseline=True, max_new_tokens=8)
    assert out.result.tokens == out.baseline.tokens and len(out.result.tokens) == 8
    assert isinstance(out.text, str)


def test_sliding_window_models_are_detected():
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    from omnidraft.data.models import sliding_window

    assert sliding_window(Gemma3TextConfig(sliding_window=512)) == 512
    assert sliding_window(Qwen2Config()) is None and sliding_window(LlamaConfig()) is None


def test_omnidraft_method_adapts_online_and_stays_lossless(tmp_path):
    s = run(_cfg(tmp_path, "method=omnidraft", "method.adapt.interval=2", "task.limit=4",
                 "decode.max_new_tokens=12"))
    assert s["lossless/match_rate"] == 1.0 and s["adapt/n_updates"] == 2
    assert 0 < s["adapt/time_share"] < 1 and s["ngram/size"] > 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("adapt/loss" in r) for r in rows] == [False, True, False, True]


def test_omnidraft_pl_cuts_the_lm_draft_at_its_confidence(tmp_path):
    """method=omnidraft_pl wires policy=confidence: the LM drafts fewer tokens per model step than
    under the fixed length, and the output stays the target's."""
    over = ("method=omnidraft_pl", "task.limit=3", "decode.max_new_tokens=16", "method.adapt.enabled=false")
    conf = run(_cfg(tmp_path / "c", *over, "method.draft_length.min_prob=0.9"))
    fixed = run(_cfg(tmp_path / "f", *over, "method.draft_length.policy=fixed"))
    assert conf["lossless/match_rate"] == 1.0 == fixed["lossless/match_rate"]

    def lm_tokens_per_lm_step(d):
        rows = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        lm_steps = sum(r["sd/steps"] - r.get("draft/lookup_steps", 0) for r in rows)
        return sum(r["draft/mean_len"] * r["sd/steps"] for r in rows) / max(1, lm_steps)

    assert lm_tokens_per_lm_step("c") < lm_tokens_per_lm_step("f")


def test_adapt_with_a_drafter_that_cannot_learn_is_refused(tmp_path):
    import pytest

    from omnidraft.errors import OmniDraftError

    with pytest.raises(OmniDraftError, match="NgramDrafter"):
        run(_cfg(tmp_path, "method=spd_dm", "method.adapt.enabled=true"))


_STREAM = ("method=omnidraft", "method.adapt.interval=2", "task.limit=6", "decode.max_new_tokens=12",
           "checkpoint_every=3")
_SAME = ("prompt/id", "text/output", "sd/accepted", "sd/proposed", "sd/steps", "ngram/size", "ngram/hits",
         "adapt/loss", "adapt/loss_dm", "adapt/loss_ngram", "adapt/n_examples", "lossless/match")


def run_until_crash(monkeypatch, cfg, at_row: int) -> None:
    """Run ``cfg`` and raise a simulated crash while building row ``at_row`` (1-based)."""
    import pytest

    import omnidraft.runner as runner

    calls = {"n": 0}
    real_row = runner.drafter_row

    def crashing_row(*a, **kw):
        calls["n"] += 1
        if calls["n"] == at_row:
            raise RuntimeError("simulated crash")
        return real_row(*a, **kw)

    monkeypatch.setattr(runner, "drafter_row", crashing_row)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg)
    monkeypatch.setattr(runner, "drafter_row", real_row)


def _rows(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def test_save_then_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """Crash after prompt 4 (state saved after prompt 3, with one prompt's examples still in the
    update buffer), resume: outputs, losses and cache equal the uninterrupted seeded run."""
    full = run(_cfg(tmp_path / "full", *_STREAM))
    run_until_crash(monkeypatch, _cfg(tmp_path / "cut", *_STREAM), at_row=5)
    assert len(_rows(tmp_path / "cut")) == 4  # prompt 3 was logged after the checkpoint
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["status"].startswith("failed")
    resumed = run(_cfg(tmp_path / "cut", *_STREAM, "resume=true"))
    assert resumed["resumed_at"] == 3 and resumed["n_prompts"] == 6
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "cut")
    assert [r["prompt/index"] for r in b] == list(range(6))
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in _SAME} == {k: rb.get(k) for k in _SAME}
    for key in ("accept/rate", "accept/mean_len", "ngram/size", "adapt/n_updates"):
        assert full[key] == resumed[key], key
    segs = resumed["provenance"]["segments"]
    assert [s["start"] for s in segs] == [0, 3]
    # each segment says which CPU ISA it ran on: a stream resumed on another machine shows it
    assert all(s["cpu_capability"] == resumed["provenance"]["cpu_capability"] for s in segs)
    # ... and whether bf16 is native there (torch says AVX512 with or without AVX512-BF16)
    assert all(s["cpu_flags"] == resumed["provenance"]["cpu_flags"] for s in segs)
    assert resumed["provenance"]["cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "NO AVX", "ZVECTOR", "VSX"}


def test_resume_refuses_a_different_config_and_a_missing_state(tmp_path):
    import pytest

    from omnidraft.errors import OmniDraftError

    with pytest.raises(OmniDraftError, match="no online state"):  # a state_dir named but absent
        run(_cfg(tmp_path / "none", *_STREAM, "resume=true", f"state_dir={tmp_path / 'absent'}"))
    with pytest.warns(UserWarning, match="no checkpoint yet"):  # killed before its first checkpoint
        s = run(_cfg(tmp_path / "early", *_STREAM, "resume=true"))
    assert s["status"] == "ok"
    run(_cfg(tmp_path / "a", *_STREAM))
    with pytest.raises(OmniDraftError, match="method.adapt.lam"):
        run(_cfg(tmp_path / "a", *_STREAM, "resume=true", "method.adapt.lam=0.5"))


def test_init_state_serves_an_adapted_drafter(tmp_path):
    """A drafter adapted on one stream starts the next session with its weights (LoRA too)."""
    import copy

    import torch

    from omnidraft import state as state_io
    from omnidraft.learn.lora import with_lora
    from omnidraft.runner import Session

    for name, extra in (("full", ()), ("lora", ("method.adapt.lora_rank=4",))):
        run(_cfg(tmp_path / name, *_STREAM, *extra))
        saved = state_io.load(tmp_path / name / "state")
        assert saved.meta["learner"]["n_updates"] == 3 and saved.meta["drafter"]["ngram"]["entries"] is not None
        loaded = [k[len("param."):] for k in saved.tensors if k.startswith("param.")]
        assert loaded
        if name == "lora":  # reference: a fresh base drafter with the saved adapters (peft, unmerged)
            assert saved.meta["lora"][0] == 4 and all("lora_" in n for n in loaded)
            fresh = Session(_cfg(tmp_path / "base", "ablation=cache_pp")).draft_lm.model
            ref = with_lora(copy.deepcopy(fresh).float(), *saved.meta["lora"])
            state_io.load_weights(ref, saved.tensors)
            ids = torch.tensor([[5, 17, 42, 99, 3, 64, 8]])
        for method in ("ablation=cache_pp", "method=omnidraft"):
            sess = Session(_cfg(tmp_path / f"{name}_next", method, f"drafter.init_state={tmp_path / name}"))
            served = sess.draft_lm.model
            if name == "full":
                params = dict(served.named_parameters())
                assert all(torch.equal(params[n], saved.tensors[f"param.{n}"].to(params[n].dtype)) for n in loaded)
            else:  # served plain, adapters merged: the adapter model's logits, no adapter modules
                assert not any("lora_" in n for n, _ in served.named_parameters())
                with torch.no_grad():
                    torch.testing.assert_close(served(input_ids=ids).logits.float(), ref(input_ids=ids).logits,
                                               rtol=1e-4, atol=1e-4)
                    assert not torch.allclose(fresh(input_ids=ids).logits.float(), ref(input_ids=ids).logits)
            if sess.learner is not None:  # training continues from the saved master weights
                master = dict(zip(sess.learner.names, sess.learner.master))
                assert all(torch.equal(master[n], saved.tensors[f"param.{n}"].to(master[n].dtype)) for n in loaded)
            assert len(sess.drafter.ngram) == 0  # the n-gram cache belongs to its own stream


def test_python_api_adapts_across_calls():
    from omnidraft.api import load

    dec = load(method="omnidraft", overrides=["debug=tiny", "method.adapt.interval=2", "method.k=3"])
    for text in ("Hello there", "The quick brown fox", "def f(x):", "1 + 1 ="):
        out = dec.generate_text(text, with_baseline=True, max_new_tokens=8)
        assert out.result.tokens == out.baseline.tokens
    st = dec.stats()
    assert st["calls"] == 4 and st["adapt/n_updates"] == 2 and st["adapt/buffer"] == 0
    assert 0 <= st["accept/rate"] <= 1 and "ngram/size" in st and "adapt/loss" in st


def test_python_api_trains_the_acceptance_head_too():
    from omnidraft.api import load

    dec = load(method="omnidraft", overrides=["debug=tiny", "ablation=adaptive_interleaved", "method.adapt.interval=2",
                                              "method.draft_length.k_max=6"])
    for text in ("Hello there", "The quick brown fox", "def f(x):"):
        dec.generate_text(text, max_new_tokens=8)
    st = dec.stats()
    assert st["head/n_updates"] == 3 and st["adapt/n_updates"] == 1  # head every prompt, drafter every 2
    assert 0 < st["head/pred_accept"] < 1 and "head/loss" in st


def test_summary_windows_never_overlap():
    from omnidraft.tables import summarise

    rows = [{"sd/proposed": 10, "sd/accepted": a, "sd/steps": 5, "sd/new_tokens": 8, "sd/wall_s": 1.0,
             "sd/draft_s": 0.1, "sd/target_s": 0.8} for a in (1, 2, 3, 7, 8, 9)]
    s = summarise(rows, True, window=50)
    assert s["accept/window"] == 3
    assert s["accept/rate_first_window"] == 0.2 and s["accept/rate_last_window"] == 0.8
    assert summarise(rows, True, window=2)["accept/rate_last_window"] == 0.85


def test_only_changes_outside_the_output_folders_make_the_code_dirty():
    from omnidraft.provenance import code_dirty

    outputs = "?? results/paper/table6/cpu/run/\n M results/paper/table5/cpu/multirun.yaml\nA  outputs/x.json\n"
    assert not code_dirty("") and not code_dirty(outputs)
    assert code_dirty(outputs + " M omnidraft/runner.py\n")
    assert code_dirty("?? experiments/new.sh\n") and code_dirty("R  results/a.md -> README.md\n")
    assert not code_dirty('R  omnidraft/old.md -> "results/a b.md"\n')  # moved into the outputs
