"""Replay with learners: the online learner, LoRA, OSD and the acceptance head see, under replay from
a target trace, exactly the rows live verification gives them (one batched target forward per
prompt instead of one per step), so a replayed stream adapts as the live one does.

Through :class:`omnidraft.runner.Session` on a cross-vocabulary pair (Qwen2 tokenizer target,
Llama-2 tokenizer drafter whose weights copy the target's through the direct map, plus noise, so
drafts are accepted AND rejected: rows on the trajectory and on drafted branches both matter).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PROMPTS, aligned_drafter, cross_pair, tiny
from hydra import compose, initialize_config_dir

from omnidraft.config import CONF_DIR, register_configs
from omnidraft.data.models import LoadedModel, load_vocab_tokenizer
from omnidraft.runner import Session

N_PROMPTS, N_NEW = 20, 24
COMMON = ["debug=tiny", f"decode.max_new_tokens={N_NEW}", "logger=none", "progress=false", "method.adapt.interval=2"]
CASES = {
    "spd_dm": ["method=spd_dm"],
    "cache_pp": ["ablation=cache_pp"],
    "omnidraft": ["method=omnidraft"],
    "lora": ["ablation=lora", "method.adapt.lora_rank=4"],
    "osd": ["method=osd"],
    "heuristic_k": ["ablation=heuristic_k"],
    "head_joint": ["ablation=adaptive_joint"],
    "head_interleaved": ["ablation=adaptive_interleaved"],
}


@pytest.fixture(scope="module")
def noisy_pair(cache_dir):
    target, ttok, _, dtok, bridge = cross_pair(*tiny("qwen2", "qwen2", 1, cache_dir),
                                               load_vocab_tokenizer("llama-spm", cache_dir), cache_dir)
    return target, ttok, aligned_drafter(target, bridge, len(dtok), seed=7, noise=0.15), dtok


def _session(pair, overrides: list[str]) -> Session:
    target, ttok, drafter, dtok = pair
    lm = lambda name, m, tok: LoadedModel(name, m, tok, torch.float32, torch.device("cpu"), 2048, 0.0, "tiny")  # noqa: E731
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=unused", *COMMON, *overrides])
    return Session(cfg, target=lm("tiny_qwen2", target, ttok), draft=lm("noisy_llama2", copy.deepcopy(drafter), dtok))


def _weights(sess: Session) -> dict[str, torch.Tensor]:
    weights = {}
    if sess.learner is not None:
        weights.update({f"master.{i}": p.detach().clone() for i, p in enumerate(sess.learner.master)})
    if sess.head_learner is not None:
        weights.update({f"head.{k}": v.detach().clone() for k, v in sess.head_learner.head.state_dict().items()})
    return weights


def _stream(sess: Session) -> dict:
    """Every prompt: output, per-step (proposed, accepted), the updates' losses; the weights before
    and after."""
    start = _weights(sess)
    steps, tokens, losses = [], [], []
    for i, text in enumerate(PROMPTS[:N_PROMPTS]):
        res = sess.generate(sess.prompt_ids(text), seed=1000 + i)
        upd = sess.after_prompt(i)
        tokens.append(res.tokens)
        steps.append([(s.proposed, s.accepted) for s in res.steps])
        losses.append({k: v for k, v in upd.items() if k.startswith(("adapt/loss", "head/loss"))})
    ngram = sess.drafter.ngram.state_dict() if hasattr(sess.drafter, "ngram") else None
    return {"steps": steps, "tokens": tokens, "losses": losses, "start": start, "weights": _weights(sess),
            "ngram": ngram}


def _trace(pair) -> dict[tuple[int, ...], list[int]]:
    """The target's greedy output of every prompt (what `omnidraft trace` records)."""
    sess = _session(pair, ["method=spd_dm"])
    return {tuple(ids): sess.generate(ids, baseline=True).tokens
            for ids in (sess.prompt_ids(t) for t in PROMPTS[:N_PROMPTS])}


@pytest.fixture(scope="module")
def trace(noisy_pair):
    return _trace(noisy_pair)


def _differences(live: dict, rep: dict, weights: str = "abs") -> list[str]:
    """What differs between two streams. ``weights``: ``abs`` (every element within 1e-5) or
    ``update`` (per tensor, the difference within 1e-3 of the stream's own change of it: float
    rounding in a row reaches Adam's normalised step on weights whose gradients are ~0, and moves
    those by up to the learning rate, so elementwise equality is a bar for bit-identical rows only)."""
    out = []
    if rep["tokens"] != live["tokens"]:
        out.append("tokens")
    if rep["steps"] != live["steps"]:
        out.append("steps")
    if rep["ngram"] != live["ngram"]:
        out.append("ngram cache")
    if [sorted(x) for x in rep["losses"]] != [sorted(x) for x in live["losses"]]:
        out.append("loss keys")
    else:
        for i, (a, b) in enumerate(zip(live["losses"], rep["losses"])):
            for k in a:
                if abs(a[k] - b[k]) > 1e-5 * max(1.0, abs(a[k])):
                    out.append(f"update after prompt {i}: {k} {a[k]!r} != {b[k]!r}")
    for k, w in live["weights"].items():
        diff = w - rep["weights"][k]
        if weights == "abs" and float(diff.abs().max()) > 1e-5:
            out.append(f"weights {k}: max |diff| {float(diff.abs().max()):.2e}")
        if weights == "update":
            change = float((w - live["start"][k]).norm())
            if float(diff.norm()) > 1e-3 * change:
                out.append(f"weights {k}: |diff| {float(diff.norm()):.2e} vs |change| {change:.2e}")
    return out


@pytest.fixture(scope="module")
def live_runs(noisy_pair):
    return {}


@pytest.mark.parametrize("rows", ["stepwise", "batched"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_equals_live_with_learners(noisy_pair, trace, live_runs, case, rows):
    """20 prompts, updates every 2: identical per-step (proposed, accepted) and outputs, the same
    losses per update (within 1e-5) and the same weights after the stream: within 1e-5 elementwise
    for rows replayed stepwise (bit-identical rows); for batched rows (float rounding apart) within
    1e-3 of the stream's own change of each tensor."""
    if case not in live_runs:
        live_runs[case] = _stream(_session(noisy_pair, CASES[case]))
    live = live_runs[case]
    sess = _session(noisy_pair, CASES[case])
    sess.use_trace(trace, rows=rows)
    rep = _stream(sess)
    assert _differences(live, rep, "abs" if rows == "stepwise" else "update") == []
    accepted = sum(a for st in live["steps"] for _, a in st)
    rejected = sum(p - a for st in live["steps"] for p, a in st)
    assert accepted > 20 and rejected > 20  # both the trajectory's rows and the branches' were used
    if sess.learner is not None:
        assert any(live["losses"]) and live["weights"]
        assert sess.verifier.target is not None  # the learner's rows came from the batched target forward


def test_a_row_from_the_wrong_position_is_caught(noisy_pair, trace):
    """The exactness check above has teeth: replay feeding the learner each step's rows shifted by
    one trajectory position gives other losses and weights."""
    live = _stream(_session(noisy_pair, CASES["omnidraft"]))
    sess = _session(noisy_pair, CASES["omnidraft"])
    sess.use_trace(trace)
    rows_of_step = sess.verifier._rows_of_step
    sess.verifier._rows_of_step = lambda traj, branch, pos, ids, n: rows_of_step(
        traj, branch, min(pos + 1, len(traj) - n - 1), ids, n)
    diffs = _differences(live, _stream(sess), "update")
    assert any(d.startswith("update after") for d in diffs) and any(d.startswith("weights") for d in diffs)


@pytest.mark.parametrize("case", ["omnidraft", "lora"])
def test_a_rows_store_serves_later_runs_the_same_rows(noisy_pair, trace, live_runs, tmp_path, case):
    """replay.rows_cache: the first replay computes and stores each prompt's trajectory (key/value
    cache and last-layer states), a second one loads them (no trajectory forward), and both adapt
    as live does (the batched rows' bar); a damaged file is recomputed."""
    if case not in live_runs:
        live_runs[case] = _stream(_session(noisy_pair, CASES[case]))
    live = live_runs[case]
    ident = {"name": "tiny_qwen2", "dtype": "float32"}
    runs = []
    for _ in range(2):
        sess = _session(noisy_pair, CASES[case])
        sess.use_trace(trace, store_dir=str(tmp_path), target_identity=ident)
        runs.append((_stream(sess), sess.verifier.store))
    (first, s1), (second, s2) = runs
    assert s1.hits == 0 and s1.misses == N_PROMPTS and len(list(s1.dir.glob("*.safetensors"))) == N_PROMPTS
    assert s2.hits == N_PROMPTS and s2.misses == 0
    assert _differences(live, first, "update") == [] and _differences(live, second, "update") == []
    assert second["steps"] == first["steps"] and second["losses"] == first["losses"]
    for k, w in first["weights"].items():
        assert torch.equal(w, second["weights"][k])  # stored and computed trajectories: the same numbers
    # another target identity is another namespace; a damaged file is a miss, recomputed
    f = sorted(s1.dir.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:100])
    sess = _session(noisy_pair, CASES[case])
    sess.use_trace(trace, store_dir=str(tmp_path), target_identity=ident)
    assert _stream(sess)["steps"] == first["steps"] and sess.verifier.store.misses == 1
    sess = _session(noisy_pair, CASES[case])
    sess.use_trace(trace, store_dir=str(tmp_path), target_identity={**ident, "dtype": "bfloat16"})
    assert sess.verifier.store.dir != s1.dir
