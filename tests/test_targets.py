"""One drafter for all targets: per-target drafter parts (n-gram cache, LoRA adapters, acceptance
head) keyed by the target's tokenizer, a stream that switches target mid-way (``target_switch``),
and a saved state that carries every target's parts across runs.

Tiny random-weight models with REAL, different tokenizers: targets tiny_qwen2 (A, Qwen2 tokenizer)
and tiny_llama3 (B, Llama-3 tokenizer), a third target tiny_llama2 (Llama-2 tokenizer), and the
tiny_llama2 drafter of ``debug=tiny``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, PROMPTS, compose_run, metrics_rows
from hydra import compose, initialize_config_dir

from omnidraft import state as state_io
from omnidraft.config import register_configs, target_defaults
from omnidraft.errors import OmniDraftError
from omnidraft.runner import Session, check_config, run

A, B, C = "tiny_qwen2", "tiny_llama3", "tiny_llama2"
N_NEW = 16
BASE = ["debug=tiny", "task=gsm8k", f"decode.max_new_tokens={N_NEW}", "logger=none", "progress=false",
        "warmup_prompts=1"]
LORA = ["ablation=lora", "method.adapt.lora_rank=4", "method.adapt.interval=2"]
SHARED = ["drafter=tiny_qwen2"]  # A's own weights and tokenizer: drafts are accepted on A, cross-vocab on B
SWITCH = [f"target_switch.targets=[{A},{B},{A}]", "target_switch.at=[2,4]", "task.limit=6"]


def _cfg(tmp: Path, name: str, *over: str, config: str = "config"):
    return compose_run(tmp, name, BASE, *over, config=config)


def _rows(d: Path) -> list[dict]:
    return metrics_rows(d)


def _ngram(sess: Session) -> dict:
    return sess.drafter.ngram.state_dict()


def _j(x):
    """As JSON has it (tuples become lists): saved and live states compare so."""
    return json.loads(json.dumps(x))


def _adapters(sess: Session) -> list[torch.Tensor]:
    return [p.detach().clone() for p in sess.learner.master]


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    """A -> B -> A over 6 GSM8K prompts (switches at 2 and 4), omnidraft with LoRA, ar on every prompt."""
    tmp = tmp_path_factory.mktemp("targets")
    # one thread, as the runs compared with it exactly pin (threads=N is process-wide: an earlier run may have set it)
    return tmp, run(_cfg(tmp, "switch", *SWITCH, *SHARED, *LORA, "checkpoint_every=1", "threads=1"))


def test_a_switching_stream_is_lossless_on_every_target(switched):
    """Greedy output equals each target's own greedy output, before and after each switch: the
    ar measured in the run and a separate ar run of that target on those prompts."""
    tmp, s = switched
    rows = _rows(tmp / "switch")
    assert [r["target"] for r in rows] == [A, A, B, B, A, A]
    assert all(r["lossless/match"] for r in rows) and s["lossless/match_rate"] == 1.0
    for name, a, b in ((A, 0, 2), (B, 2, 4), (A, 4, 6)):
        run(_cfg(tmp, f"ar_{name}_{a}", "method=ar", f"target={name}", f"task.offset={a}", f"task.limit={b - a}"))
        assert [r["text/output"] for r in _rows(tmp / f"ar_{name}_{a}")] == [r["text/output"] for r in rows[a:b]]
    assert s["targets"] == [A, B, A]
    assert [(t["target"], t["first_prompt"], t["last_prompt"]) for t in s["by_target"]] == [(A, 0, 1), (B, 2, 3),
                                                                                             (A, 4, 5)]
    rates = [t["accept/rate"] for t in s["by_target"]]
    assert rates[0] > 0.3 and rates[2] > 0.3 and rates[1] < rates[0]  # drafts accepted on A, before and after B


def test_back_on_a_the_drafter_has_a_parts_again(tmp_path):
    """A -> B -> A in one session: B starts with an empty n-gram cache and fresh LoRA adapters;
    back on A, A's cache, adapters, their AdamW moments and the served (merged) weights are exactly
    what they were at the switch."""
    sess = Session(_cfg(tmp_path, "s", *SWITCH, *LORA))
    fresh = _adapters(sess)
    for i, text in enumerate(PROMPTS[:4]):  # two updates on A
        sess.generate(sess.prompt_ids(text), seed=i)
        sess.after_prompt(i)
    assert sess.learner.n_updates == 2 and len(sess.drafter.ngram) > 0
    a_cache, a_adapters = _ngram(sess), _adapters(sess)
    a_moments = {k: v.clone() for k, v in state_io.optimizer_state(sess.learner.opt, "opt")[0].items()}
    a_served = {n: p.detach().clone() for n, p in sess.draft_lm.model.named_parameters()}
    assert any(not torch.equal(x, y) for x, y in zip(a_adapters, fresh))

    sess.use_target(B)
    assert sess.target.name == B and len(sess.drafter.ngram) == 0  # B's cache, empty
    assert all(torch.equal(x, y) for x, y in zip(_adapters(sess), fresh))  # B's adapters, as initialised
    assert not sess.learner.opt.state
    for i, text in enumerate(PROMPTS[4:8], start=4):
        sess.generate(sess.prompt_ids(text), seed=i)
        sess.after_prompt(i)
    b_cache = _ngram(sess)
    assert b_cache["entries"] and b_cache != a_cache

    sess.use_target(A)
    assert _ngram(sess) == a_cache
    assert all(torch.equal(x, y) for x, y in zip(_adapters(sess), a_adapters))
    moments = state_io.optimizer_state(sess.learner.opt, "opt")[0]
    assert moments.keys() == a_moments.keys() and all(torch.equal(moments[k], a_moments[k]) for k in moments)
    served = dict(sess.draft_lm.model.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in a_served.items())
    sess.use_target(B)
    assert _ngram(sess) == b_cache


def test_each_target_trains_its_own_acceptance_head(tmp_path):
    """Joint head + full fine-tuning across A -> B -> A: B starts with a fresh head, trained in the
    drafter's update; back on A, A's head (and its moments) is exactly as at the switch and is the
    one the update trains, while the drafter's weights are shared: B's updates stay."""
    sess = Session(_cfg(tmp_path, "s", *SWITCH, "ablation=adaptive_joint", "method.adapt.interval=2",
                        "method.draft_length.k_max=6"))

    def head_state():
        return {k: v.clone() for k, v in sess.head_learner.state_dict()[0].items()}

    for i, text in enumerate(PROMPTS[:2]):
        sess.generate(sess.prompt_ids(text), seed=i)
        sess.after_prompt(i)
    a_head, a_learner = head_state(), sess.head_learner
    assert sess.learner.head is a_learner and a_learner.n_updates == 1
    sess.use_target(B)
    assert sess.head_learner is not a_learner and sess.learner.head is sess.head_learner
    assert not any(v.any() for k, v in head_state().items() if k.startswith("head."))  # as initialised
    for i, text in enumerate(PROMPTS[2:4], start=2):
        sess.generate(sess.prompt_ids(text), seed=i)
        sess.after_prompt(i)
    assert sess.head_learner.n_updates == 1
    shared = [p.detach().clone() for p in sess.draft_lm.model.parameters()]
    sess.use_target(A)
    assert sess.head_learner is a_learner and sess.learner.head is a_learner
    now = head_state()
    assert now.keys() == a_head.keys() and all(torch.equal(now[k], a_head[k]) for k in now)
    assert all(torch.equal(p, q) for p, q in zip(sess.draft_lm.model.parameters(), shared))


def test_the_saved_state_holds_every_target_and_serves_each_its_own(switched, tmp_path):
    """The state of the switching stream (A active at the end, B filed under its tokenizer): a run
    on B takes B's cache and adapters; a third target (another tokenizer) starts empty with one
    warning, or is refused with drafter.strict_target=true; the state that third run writes keeps
    A's and B's parts untouched."""
    tmp, _ = switched
    path = tmp / "switch" / "state"
    saved = state_io.load(path)
    names = state_io.target_names(saved.meta)
    assert list(names.values()) == [A, B] and saved.meta["tokenizers"]["target_name"] == A
    b_key = next(h for h, n in names.items() if n == B)
    b_part = state_io.target_part(saved, b_key)
    init = [f"drafter.init_state={path}", "drafter.init_ngram=true"]

    sess = Session(_cfg(tmp_path, "b", f"target={B}", *SHARED, *LORA, *init))
    assert _j(_ngram(sess)) == b_part.meta["drafter"]["ngram"] and len(sess.drafter.ngram) > 0
    master = dict(zip(sess.learner.names, sess.learner.master))
    assert all(torch.equal(master[n], b_part.tensors[f"param.{n}"]) for n in sess.learner.names)
    assert sess.init_info == {"drafter/init_ngram": "loaded", "drafter/init_lora": "loaded"}

    with pytest.warns(UserWarning, match=f"built for target {A}, {B}; target {C} has another tokenizer"):
        s = run(_cfg(tmp_path, "c", f"target={C}", "task.limit=2", *SHARED, *LORA, *init))
    assert s["drafter/init_ngram"] == f"empty (state built for target {A}, {B})"
    assert s["provenance"]["drafter/init_lora"] == s["drafter/init_lora"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess_c = Session(_cfg(tmp_path, "c2", f"target={C}", *SHARED, *LORA, *init))
    assert len(sess_c.drafter.ngram) == 0
    fresh = Session(_cfg(tmp_path, "c3", f"target={C}", *SHARED, *LORA))
    assert all(torch.equal(x, y) for x, y in zip(_adapters(sess_c), _adapters(fresh)))

    with pytest.raises(OmniDraftError) as e:
        Session(_cfg(tmp_path, "strict", f"target={C}", *SHARED, *LORA, *init, "drafter.strict_target=true"))
    msg = str(e.value)
    assert "\n" not in msg and A in msg and B in msg and C in msg and "drop drafter.strict_target" in msg

    after = state_io.load(tmp_path / "c" / "state")  # C active; A and B carried as they were
    assert list(state_io.target_names(after.meta).values()) == [C, A, B]
    for h in names:
        old, new = state_io.target_part(saved, h), state_io.target_part(after, h)
        if h != b_key:  # A was the active target: its top-level parts, filed under its key now
            old = state_io.active_part(saved)
        own = lambda m: {k: v for k, v in m.items() if k not in ("name", "tokenizer")}  # noqa: E731
        assert own(new.meta) == own(old.meta) and new.meta["name"] == names[h]
        assert new.tensors.keys() == old.tensors.keys()
        assert all(torch.equal(new.tensors[k], old.tensors[k]) for k in old.tensors)


def test_a_to_b_to_a_across_runs_gets_a_parts_back(tmp_path):
    """Run on A, then a run on B from its state, then one on A from that: A's cache comes back."""
    run(_cfg(tmp_path, "a", "task.limit=3", "method.adapt.interval=2"))
    a_cache = state_io.load(tmp_path / "a" / "state").meta["drafter"]
    with pytest.warns(UserWarning, match=f"target {B} has another tokenizer"):
        run(_cfg(tmp_path, "b", f"target={B}", "task.limit=2", f"drafter.init_state={tmp_path / 'a' / 'state'}",
                 "drafter.init_ngram=true"))
    sess = Session(_cfg(tmp_path, "a2", f"drafter.init_state={tmp_path / 'b' / 'state'}", "drafter.init_ngram=true"))
    assert _j(sess.drafter.state_dict()) == a_cache and sess.init_info == {"drafter/init_ngram": "loaded"}


def test_states_from_before_per_target_parts_still_load(tmp_path):
    """A state with no ``targets`` section holds the parts of ``meta.tokenizers.target``: they
    serve that target, another one starts empty; a state that records no target tokenizer (older
    bench checkpoints) is taken as the run's target's, quietly only where it names that target."""
    run(_cfg(tmp_path, "a", "task.limit=2", "ablation=adaptive_joint", "method.adapt.interval=2"))
    path = tmp_path / "a" / "state"
    meta = json.loads((path / "meta.json").read_text())
    assert "targets" not in meta
    meta["tokenizers"].pop("target_name")  # what states of the previous code recorded
    (path / "meta.json").write_text(json.dumps(meta))
    saved = state_io.load(path)
    init = [f"drafter.init_state={path}", "drafter.init_ngram=true", "ablation=adaptive_joint"]
    sess = Session(_cfg(tmp_path, "a2", *init))
    assert _j(sess.drafter.state_dict()) == saved.meta["drafter"]
    assert torch.equal(sess.head_learner.head.out.weight, saved.tensors["head.out.weight"])
    assert sess.init_info == {"drafter/init_ngram": "loaded", "drafter/init_head": "loaded"}
    with pytest.warns(UserWarning, match=f"built for target {A}"):  # the name, from the saved fingerprint
        sess_b = Session(_cfg(tmp_path, "b", f"target={B}", *init))
    assert len(sess_b.drafter.ngram) == 0 and not sess_b.head_learner.head.out.weight.any()

    meta.pop("tokenizers")  # no tokenizer recorded: its parts serve the run's target, never silently
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=f"records no target tokenizer \\(built for target {A}\\): its n-gram "
                      f"cache, acceptance head are taken as target {B}'s"):
        sess_b = Session(_cfg(tmp_path, "b2", f"target={B}", *init))
    assert _j(sess_b.drafter.state_dict()) == saved.meta["drafter"]
    with pytest.raises(OmniDraftError, match="records no target tokenizer.*drafter.strict_target=true"):
        Session(_cfg(tmp_path, "b3", f"target={B}", *init, "drafter.strict_target=true"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the target it names: no warning
        sess_a = Session(_cfg(tmp_path, "a3", *init, "drafter.strict_target=true"))
    assert _j(sess_a.drafter.state_dict()) == saved.meta["drafter"]
    meta.pop("fingerprint")  # nothing recorded at all
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="built for target <not recorded>"):
        Session(_cfg(tmp_path, "a4", *init))


def test_lora_states_served_frozen_follow_the_target(switched, tmp_path):
    """A switching state's LoRA adapters served frozen on a switching stream (no learner): on each
    target the served drafter is the base with THAT target's adapters merged, as a one-target
    session serving the same state merges them."""
    tmp, _ = switched
    init = [*SHARED, f"drafter.init_state={tmp / 'switch' / 'state'}", "ablation=cache_pp"]
    sess = Session(_cfg(tmp_path, "s", *SWITCH, *init))
    assert sess.learner is None and sess.lora
    for name in (A, B, A):
        sess.use_target(name)
        one = Session(_cfg(tmp_path, name, f"target={name}", *init))
        ref = dict(one.draft_lm.model.named_parameters())
        assert all(torch.equal(p, ref[n]) for n, p in sess.draft_lm.model.named_parameters()), name


def test_a_switching_stream_resumes_like_an_uninterrupted_one(switched, tmp_path, monkeypatch):
    """Cut in B's segment (after prompt 2's checkpoint), resume: the same rows as the uninterrupted
    stream, and the state at the end the same parts for both targets."""
    from test_runner import run_until_crash

    tmp, _ = switched
    over = (*SWITCH, *SHARED, *LORA, "checkpoint_every=1", "threads=1")
    run_until_crash(monkeypatch, _cfg(tmp_path, "cut", *over), at_row=4)
    s = run(_cfg(tmp_path, "cut", *over, "resume=true"))
    assert s["resumed_at"] == 3
    key = ("prompt/id", "target", "sd/step_proposed", "sd/step_accepted", "text/output", "adapt/loss", "ngram/size")
    a, b = _rows(tmp / "switch"), _rows(tmp_path / "cut")
    assert [tuple(r.get(k) for k in key) for r in a] == [tuple(r.get(k) for k in key) for r in b]
    x, y = state_io.load(tmp / "switch" / "state"), state_io.load(tmp_path / "cut" / "state")
    assert x.meta["targets"] == y.meta["targets"] and x.meta["drafter"] == y.meta["drafter"]
    assert all(torch.equal(x.tensors[k], y.tensors[k]) for k in x.tensors if k.startswith(("targets.", "param.")))


def test_a_switching_stream_replays_from_each_targets_trace(switched, tmp_path):
    """engine=replay: each segment from its own target's trace (and calibration); the same steps,
    outputs and losses as the live stream. A missing trace names the command for that segment."""
    from omnidraft.calibrate import run_calibrate
    from omnidraft.trace import run_trace

    tmp, _ = switched
    rep = (*SWITCH, *SHARED, *LORA, "engine=replay", "threads=1")

    def trace(name: str, a: int) -> None:
        run_trace(_cfg(tmp_path, f"trace_{a}", f"target={name}", f"task.offset={a}", "task.limit=2", config="trace"))

    def calibrate(name: str) -> None:
        run_calibrate(_cfg(tmp_path, f"cal_{name}", f"target={name}", *SHARED, "calibrate.repeats=2",
                           "calibrate.warmup=1", "calibrate.context_tokens=32", "threads=1", config="calibrate"))

    trace(A, 0)
    trace(A, 4)
    calibrate(A)
    with pytest.raises(OmniDraftError, match=f"omnidraft trace .*target={B} task.offset=2 task.limit=2$"):
        run(_cfg(tmp_path, "none", *rep))
    trace(B, 2)
    with pytest.raises(OmniDraftError, match=f"omnidraft calibrate .*target={B}"):
        run(_cfg(tmp_path, "none", *rep))
    calibrate(B)
    s = run(_cfg(tmp_path, "replay", *rep))
    key = ("prompt/id", "target", "sd/step_proposed", "sd/step_accepted", "text/output")
    a, b = _rows(tmp / "switch"), _rows(tmp_path / "replay")
    assert [tuple(r[k] for k in key) for r in a] == [tuple(r[k] for k in key) for r in b]
    for x, y in zip(a, b):
        if "adapt/loss" in x:
            assert y["adapt/loss"] == pytest.approx(x["adapt/loss"], rel=1e-4, abs=1e-6)  # batched rows: float rounding
    assert set(s["replay/targets"]) == {A, B} and s["replay/targets"][A]["replay/trace_lines"] == 4
    assert all("speed/modelled_speedup" in t for t in s["by_target"])


@pytest.mark.parametrize("over,match", [
    ([f"target_switch.targets=[{A},nope]", "target_switch.at=[2]"], "target_switch.targets: no target 'nope'"),
    ([f"target_switch.targets=[{B},{A}]", "target_switch.at=[2]"], f"starts with {B} but the run's target is {A}"),
    ([f"target_switch.targets=[{A},{B}]", "target_switch.at=[2,3]"], "give n >= 2 targets and the n - 1"),
    ([f"target_switch.targets=[{A},{B},{A}]", "target_switch.at=[3,3]"], "must rise strictly"),
    ([*SWITCH, "method=pld"], "method=pld has none"),
    ([*SWITCH, "method=uag"], "method=uag has none"),
    ([*SWITCH, "protocol=train_test"], "protocol=train_test evaluates one target"),
])
def test_bad_switches_are_refused_before_any_model_loads(tmp_path, over, match):
    with pytest.raises(OmniDraftError, match=match):
        check_config(_cfg(tmp_path, "r", *over))


def test_a_bad_target_name_is_one_line_on_the_command_line(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import one_error_line

    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "omnidraft", "debug=tiny", f"target_switch.targets=[{A},qwen_typo]",
                           "target_switch.at=[2]"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300, check=False)
    one_error_line(proc, "target_switch.targets: no target 'qwen_typo'", "known: ")


def test_the_bench_and_distill_refuse_a_target_switch():
    from omnidraft.bench import check_bench
    from omnidraft.distill_command import check_distill

    register_configs()
    for name, check in (("bench", check_bench), ("distill", check_distill)):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(name, overrides=["run_dir=unused", *SWITCH[:2]])
        with pytest.raises(OmniDraftError, match="decodes one target"):
            check(cfg)


def test_a_stream_too_short_for_its_switches_is_refused(tmp_path):
    with pytest.raises(OmniDraftError, match="the stream has 3 prompts, so target tiny_qwen2 would never run"):
        run(_cfg(tmp_path, "r", *SWITCH[:2], "task.limit=3"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(CONF_DIR) / "target").glob("*.yaml")))
def test_target_defaults_equal_the_composed_target(name):
    """A switch target's node (conf/target/<name>.yaml read by omnidraft.config.target_defaults) is
    what Hydra composes for target=<name>."""
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=unused", f"target={name}"])
    assert OmegaConf.to_container(target_defaults(name)) == OmegaConf.to_container(cfg.target)
