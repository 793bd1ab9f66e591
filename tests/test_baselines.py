"""Baselines in the same harness: transformers' assisted generation (uag), prompt lookup (pld),
Online Speculative Decoding (osd), DistillSpec (offline distillation) and the one-process bench."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONF_DIR, PROMPTS, aligned_drafter, eos_of
from hydra import compose, initialize_config_dir

from omnidraft.config import register_configs
from omnidraft.core.decode import generate
from omnidraft.core.feedback import Span
from omnidraft.drafting.hf_assisted import HFAssisted
from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.drafting.prompt_lookup import PromptLookupDrafter
from omnidraft.learn.observers import step_observers
from omnidraft.learn.online import OnlineLearner

N_NEW = 20


def _cfg(name, *over):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=["debug=tiny", *over])


@pytest.mark.parametrize("settings", [{}, {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic"}])
def test_uag_greedy_equals_ar_and_counts_steps(pair_llama2_qwen, settings):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    eos = eos_of(ttok)
    eng = HFAssisted(target, drafter, ttok, dtok, **settings)
    accepted = 0
    for text in PROMPTS[:8]:
        ids = ttok.encode(text, add_special_tokens=True)
        ar = generate(target, ids, max_new_tokens=N_NEW, eos_ids=eos)
        res = eng.generate(ids, max_new_tokens=N_NEW, eos_ids=eos)
        assert res.tokens == ar.tokens, text
        assert sum(s.emitted for s in res.steps) == len(res.tokens)
        assert all(0 <= s.accepted <= s.proposed for s in res.steps)
        accepted += res.accepted
    assert accepted > 0  # the aligned drafter's candidates do get accepted
    assert drafter.generation_config is not eng.assistant_config  # restored after each call


def test_uag_same_tokenizer_uses_plain_assisted_generation(qwen_tiny, cache_dir):
    from omnidraft.drafting.direct_map import build_bridge

    target, ttok = qwen_tiny
    drafter = aligned_drafter(target, build_bridge(ttok, ttok, cache_dir), target.config.vocab_size, noise=0.05)
    eng = HFAssisted(target, drafter, ttok, ttok, num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    assert eng.same_tokenizer
    eos = eos_of(ttok)
    accepted = 0
    for text in PROMPTS[:4]:
        ids = ttok.encode(text)
        res = eng.generate(ids, max_new_tokens=N_NEW, eos_ids=eos)
        assert res.tokens == generate(target, ids, max_new_tokens=N_NEW, eos_ids=eos).tokens
        assert sum(s.emitted for s in res.steps) == len(res.tokens)
        accepted += res.accepted
    assert accepted > 0


def test_uag_draft_length_is_read_by_transformers(pair_llama2_qwen):
    """num_assistant_tokens set on the assistant's generation_config bounds the candidates."""
    target, ttok, drafter, dtok, _ = pair_llama2_qwen
    eos = eos_of(ttok)
    per_step = {}
    for n in (1, 8):
        eng = HFAssisted(target, drafter, ttok, dtok, num_assistant_tokens=n,
                         num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        steps = [s for text in PROMPTS[:6]
                 for s in eng.generate(ttok.encode(text), max_new_tokens=N_NEW, eos_ids=eos).steps[1:]]
        per_step[n] = sum(s.proposed for s in steps) / len(steps)
    assert per_step[8] > per_step[1] + 1


def test_prompt_lookup_proposes_the_continuation_and_is_lossless(qwen_tiny):
    d = PromptLookupDrafter(100, {99})
    d.start([5, 6, 7, 8, 9, 5, 6])
    assert d.propose(3, 0.0, None).ids == [7, 8, 9]  # the bigram (5, 6) occurred before
    d.start([1, 2, 99, 3, 1, 2])
    assert d.propose(5, 0.0, None).ids == [99]  # stops after a target EOS
    d.start([1, 2, 3])
    assert d.propose(5, 0.0, None).ids == []
    target, ttok = qwen_tiny
    eos = eos_of(ttok)
    for text in PROMPTS[:10]:
        ids = ttok.encode(text + " " + text)  # repeated text: lookups hit
        ar = generate(target, ids, max_new_tokens=N_NEW, eos_ids=eos)
        sd = generate(target, ids, drafter=PromptLookupDrafter(target.config.vocab_size, eos), k=4,
                      max_new_tokens=N_NEW, eos_ids=eos)
        assert sd.tokens == ar.tokens


def test_context_lookup_index_finds_what_a_scan_finds():
    """The n-gram index answers as a scan of the context would: the longest n-gram (max..min) whose
    most recent EARLIER occurrence exists, and the tokens after it, on random low-entropy streams."""
    from omnidraft.drafting.prompt_lookup import ContextLookup

    def scan(ids, k, lo, hi):
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            tail = ids[len(ids) - n:]
            for s in range(len(ids) - n - 1, -1, -1):
                if ids[s: s + n] == tail:
                    return ids[s + n: s + n + k], n
        return [], 0

    g = torch.Generator().manual_seed(0)
    for lo, hi in ((1, 2), (2, 4), (3, 3)):
        look = ContextLookup(hi, lo)
        ids = torch.randint(0, 4, (3,), generator=g).tolist()
        look.reset(ids)
        for _ in range(300):
            assert look.find(5) == scan(ids, 5, lo, hi), (ids, lo, hi)
            new = torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            ids = ids + new
            look.extend(new)


def _osd(pair):
    target, ttok, _, dtok, bridge = pair
    drafter = aligned_drafter(target, bridge, len(dtok), seed=11, noise=0.2)
    learner = OnlineLearner(drafter, bridge, loss="fkl", positions="rejected", lam=0.0, lr=1e-3,
                            weight_decay=0.0, batch_size=4)
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, eos_of(ttok), learn=False)
    return target, ttok, drafter, bridge, learner, d


def test_osd_trains_only_on_rejected_positions(pair_llama2_qwen):
    target, ttok, drafter, bridge, learner, _ = _osd(pair_llama2_qwen)
    mapped = torch.nonzero(bridge.draft_mask).squeeze(1)[100:103].tolist()
    merged = [Span(bridge.to_target(d), j, j + 1) for j, d in enumerate(mapped)]
    ctx = [1, 2, 3, 4]
    logits = torch.randn(4, target.config.vocab_size, generator=torch.Generator().manual_seed(0))

    def loss_with(tl, n_accepted):
        learner.buffer.clear()
        learner.begin_sequence()
        learner.record(ctx, mapped, merged, tl, n_accepted)
        with torch.no_grad():
            return [ex.dm_pos for ex in learner.buffer], float(learner.losses(list(learner.buffer))["loss"])

    pos, base = loss_with(logits, 1)
    assert pos == [[1]]  # only the first rejected proposal
    changed = logits.clone()
    changed[0] += 5 * torch.randn(changed.shape[1], generator=torch.Generator().manual_seed(1))  # an accepted row
    changed[2] += 5 * torch.randn(changed.shape[1], generator=torch.Generator().manual_seed(2))  # after the rejection
    assert loss_with(changed, 1)[1] == pytest.approx(base, abs=1e-6)
    changed[1] += 5 * torch.randn(changed.shape[1], generator=torch.Generator().manual_seed(3))  # the rejected row
    assert loss_with(changed, 1)[1] != pytest.approx(base, abs=1e-3)
    assert loss_with(logits, 3)[0] == []  # all accepted: nothing to learn


def test_osd_greedy_stays_lossless_and_learns(pair_llama2_qwen):
    target, ttok, drafter, _, learner, d = _osd(pair_llama2_qwen)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    eos = eos_of(ttok)
    for i, text in enumerate(PROMPTS[:6]):
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=d, k=4, max_new_tokens=16, eos_ids=eos,
                        observers=step_observers(d, learner=learner)).tokens == \
            generate(target, ids, max_new_tokens=16, eos_ids=eos).tokens
        if i % 3 == 2:
            batch = list(learner.buffer)
            assert batch and all(len(ex.dm_pos) == 1 for ex in batch)
            with torch.no_grad():
                lb = float(learner.losses(batch)["loss"])
            learner.update(progress=False)
            with torch.no_grad():
                assert float(learner.losses(batch)["loss"]) < lb
    assert any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())


def test_aligned_positions_with_real_tokenizers(pair_llama2_qwen):
    from omnidraft.drafting.direct_map import Retokenizer
    from omnidraft.learn.distillspec import aligned_positions

    _, ttok, _, dtok, bridge = pair_llama2_qwen
    text = " stamps and 12 apples"
    t_ids = ttok.encode(text, add_special_tokens=False)
    d_ids = Retokenizer(dtok, bridge.draft_bytes, bridge.draft_bytes_to_id).encode(text)
    pairs = aligned_positions(t_ids, d_ids, bridge)
    assert pairs
    for j, i in pairs:  # same bytes, same offset, directly mapped
        assert bridge.draft_bytes[d_ids[j]] == bridge.target_bytes[t_ids[i]]
        assert bridge.to_target(d_ids[j]) == t_ids[i]
        assert bridge.target_text_bytes(t_ids[:i]) == b"".join(bridge.draft_bytes[d] for d in d_ids[:j])
    # ' stamps' is one Qwen2 token but two Llama-2 tokens ('▁st', 'amps'): not a training position
    spelled = {bridge.target_bytes[t_ids[i]] for _, i in pairs}
    assert b" stamps" not in spelled and b" and" in spelled
    assert aligned_positions(t_ids, d_ids[:-1], bridge) == []  # different text: nothing aligns


@pytest.mark.parametrize("data", ["drafter", "target"])
def test_distill_then_serve_distillspec(tmp_path, data):
    from omnidraft import state as state_io
    from omnidraft.distill_command import run_distill
    from omnidraft.runner import Session

    s = run_distill(_cfg("distill", f"run_dir={tmp_path / 'd'}", "task.offset=2", "task.limit=3",
                         f"distill.data={data}", "distill.max_new_tokens=16", "distill.epochs=3",
                         "distill.lr=1e-3", "progress=false"))
    assert s["status"] == "ok" and s["distill/n_examples"] >= 1 and s["distill/positions"] > 0
    assert s["distill/loss_after"] < s["distill/loss_before"]
    saved = state_io.load(tmp_path / "d" / "state")
    sess = Session(_cfg("config", f"run_dir={tmp_path / 'r'}", "method=distillspec",
                        f"drafter.init_state={tmp_path / 'd' / 'state'}"))
    params = dict(sess.draft_lm.model.named_parameters())
    assert all(torch.equal(params[k[6:]], v.to(params[k[6:]].dtype)) for k, v in saved.tensors.items())
    ids = sess.prompt_ids("Hello there")
    assert sess.generate(ids, max_new_tokens=12).tokens == sess.generate(ids, baseline=True, max_new_tokens=12).tokens


def test_distill_data_build_resumes(tmp_path):
    """An interrupted data build continues from the examples already saved, with the same result."""
    from omnidraft.distill_command import run_distill

    over = [f"run_dir={tmp_path}", "task.offset=2", "task.limit=3", "distill.max_new_tokens=12", "progress=false"]
    a = run_distill(_cfg("distill", *over))
    (tmp_path / "data" / "00001.safetensors").unlink()  # as if stopped before prompt 1 was saved
    b = run_distill(_cfg("distill", *over, "resume=true"))
    for k in ("distill/loss_before", "distill/loss_after", "distill/positions", "distill/response_tokens"):
        assert b[k] == pytest.approx(a[k], rel=1e-6), k
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # 3 + the one rebuilt prompt
    with pytest.raises(Exception, match="distill.data|data differs|differs"):
        run_distill(_cfg("distill", *over, "resume=true", "distill.data=target"))


def test_distillspec_without_a_checkpoint_or_on_its_training_prompts_is_refused(tmp_path):
    from omnidraft.distill_command import run_distill
    from omnidraft.errors import OmniDraftError
    from omnidraft.runner import check_config

    with pytest.raises(OmniDraftError, match="omnidraft distill"):
        check_config(_cfg("config", f"run_dir={tmp_path}", "method=distillspec"))
    run_distill(_cfg("distill", f"run_dir={tmp_path / 'd'}", "task.offset=2", "task.limit=2",
                     "distill.max_new_tokens=4", "progress=false"))
    state = f"drafter.init_state={tmp_path / 'd' / 'state'}"
    with pytest.raises(OmniDraftError, match="prompts 2..3, which overlap"):
        check_config(_cfg("config", f"run_dir={tmp_path}", "method=distillspec", state, "task.limit=3"))
    check_config(_cfg("config", f"run_dir={tmp_path}", "method=distillspec", state, "task.limit=2"))  # 0..1: disjoint
    check_config(_cfg("config", f"run_dir={tmp_path}", "method=distillspec", state, "task.offset=4"))


def test_bench_runs_every_method_in_one_process(tmp_path):
    from omnidraft.bench import run_bench
    from omnidraft.distill_command import run_distill
    from omnidraft.tables import BENCH_KEYS as KEYS

    run_distill(_cfg("distill", f"run_dir={tmp_path / 'd'}", "task.offset=2", "task.limit=2",
                     "distill.max_new_tokens=8", "progress=false"))
    methods = ["ar", "spd_dm", "uag", "uag_k5", "pld", "osd", "distillspec", "omnidraft"]
    res = run_bench(_cfg("bench", "overrides=['debug=tiny']", f"run_dir={tmp_path / 'run'}", f"bench.out_dir={tmp_path / 'out'}",
                         "bench.name=tiny", "bench.tasks=[synthetic]", "bench.limit=2", "decode.max_new_tokens=10",
                         f"bench.methods=[{','.join(methods)}]", "method.adapt.interval=1", "progress=false",
                         f"bench.method_overrides.distillspec=['drafter.init_state={tmp_path / 'd' / 'state'}']",
                         "bench.method_overrides.osd=['method.adapt.interval=1']"))
    assert res["status"] == "ok" and res["n_prompts"] == 2 and list(res["methods"]) == methods
    for m, a in res["methods"].items():
        assert all(k in a for k in KEYS), m
        assert a["lossless/match_rate"] == 1.0, m  # greedy: every method emits ar's tokens
        assert 0.0 <= a["overhead/share"] < 1.0 and a["mem/peak_rss_gib"] > 0 and a["mem/own_gib"] >= 0
    assert res["methods"]["ar"]["speed/speedup"] == pytest.approx(1.0)
    assert res["methods"]["osd"]["time/adapt_s"] > 0  # osd updated between prompts
    own = {m: a["mem/own_gib"] for m, a in res["methods"].items()}
    assert own["spd_dm"] == own["uag"] == own["pld"] == 0  # the shared frozen drafter / no drafter
    assert own["osd"] > own["distillspec"] > 0  # a training copy + AdamW state vs a drafter copy
    on_disk = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert set(on_disk) >= {"methods", "provenance"} and "| omnidraft |" in (tmp_path / "out" / "tiny.md").read_text()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(methods)
    split = {r["method"]: (r["sd/draft_s"], r["sd/target_s"]) for r in rows}
    assert split["ar"][1] > 0 and split["ar"][0] < 0.05 * split["ar"][1]  # ar proposes nothing
    assert split["spd_dm"][0] > split["ar"][0] and split["omnidraft"][0] > split["ar"][0]  # drafter time apart


def test_bench_task_overrides_pick_each_tasks_prompts(tmp_path):
    from omnidraft.bench import run_bench
    from omnidraft.data.tasks import load_stream
    from omnidraft.errors import OmniDraftError
    from omnidraft.lifecycle import to_plain

    over = ("overrides=['debug=tiny']", f"run_dir={tmp_path / 'run'}", f"bench.out_dir={tmp_path / 'out'}",
            "bench.name=t", "bench.tasks=[synthetic]", "bench.limit=2", "decode.max_new_tokens=4",
            "bench.methods=[ar,pld]", "progress=false")
    res = run_bench(_cfg("bench", *over, "+bench.task_overrides.synthetic=['task.offset=3']"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    task = to_plain(_cfg("config", "task=synthetic", "task.offset=3", "task.limit=2").task)
    want = [r.id for r in load_stream(task, tmp_path / "cache")]
    assert sorted({r["prompt/id"] for r in rows}) == sorted(want) and len(want) == 2
    assert res["task_overrides"]["synthetic"] == ["task.offset=3"]
    assert "synthetic: task.offset=3" in (tmp_path / "out" / "t.md").read_text()
    plain = run_bench(_cfg("bench", *over, "bench.profile=false", "bench.name=np"))
    assert all(a["overhead/share"] is None for a in plain["methods"].values())
    assert "| pld |" in (tmp_path / "out" / "np.md").read_text()
    with pytest.raises(OmniDraftError, match="only task"):
        run_bench(_cfg("bench", *over, "+bench.task_overrides.synthetic=['method.k=3']"))
    with pytest.raises(OmniDraftError, match="no task 'gsm9k'"):
        run_bench(_cfg("bench", *over, "+bench.task_overrides.gsm9k=['task.offset=1']"))


def test_bench_variants_serve_one_method_under_several_settings(tmp_path):
    """bench_suite=adaptive: one adapted state (LoRA-free tiny drafter + acceptance head) served
    frozen under fixed k, the heuristic and the head, as labelled variants of omnidraft in one bench."""
    from test_runner import _cfg as run_cfg

    from omnidraft.bench import check_bench, run_bench
    from omnidraft.errors import OmniDraftError
    from omnidraft.runner import run

    run(run_cfg(tmp_path / "s", "ablation=adaptive_joint", "method.adapt.interval=2", "task.limit=4",
                "decode.max_new_tokens=12", "method.draft_length.k_max=8"))
    variants = ["fixed_k5", "heuristic", "head", "head_g05"]
    state = [f"+bench.method_overrides.{v}=['drafter.init_state={tmp_path / 's' / 'state'}']" for v in variants]
    over = ("overrides=['debug=tiny']", "+bench_suite=adaptive", f"run_dir={tmp_path / 'run'}",
            f"bench.out_dir={tmp_path / 'out'}", "bench.tasks=[synthetic]", "bench.limit=3",
            "+bench.task_overrides.synthetic=['task.offset=4']", "decode.max_new_tokens=16", "progress=false")
    res = run_bench(_cfg("bench", *over, *state))
    assert list(res["methods"]) == ["ar", *variants] and res["variants"]["head_g05"]["method"] == "omnidraft"
    a = res["methods"]
    assert all(a[v]["lossless/match_rate"] == 1.0 for v in variants)  # greedy: every policy emits ar's tokens
    assert all(a[v]["time/adapt_s"] == 0 for v in variants)  # served frozen
    draft = {v: a[v]["accept/proposed_per_step"] for v in variants}
    assert draft["heuristic"] != draft["fixed_k5"] and draft["head"] != draft["fixed_k5"], draft  # policies apply
    md = (tmp_path / "out" / "bench_policies.md").read_text()
    assert "head_g05 = omnidraft method.adapt.enabled=false" in md and "| heuristic |" in md
    with pytest.raises(OmniDraftError, match="head_learn=false serves a trained head"):
        run_bench(_cfg("bench", *over, "bench.methods=[ar,head]", "bench.name=nohead"))  # no state: no head
    bad = [("+bench.variants.pld={method:omnidraft}", "is a method's name"),
           ("+bench.variants.x={method:omnidraf}", "x.method=.omnidraf. is not a method"),
           ("+bench.variants.z={overrides:['method.k=3']}", "give a method and a list"),
           ("bench.methods=[ar,fixed_k6]", "unknown method 'fixed_k6'.*variants: fixed_k5"),
           ("+bench.variants.y={method:omnidraft,overrides:['method=sd']}", "the variant's method is"),
           ("bench.methods=[ar,head,head]", "lists a method twice")]
    for o, msg in bad:
        with pytest.raises(OmniDraftError, match=msg):
            check_bench(_cfg("bench", *over, o))


def test_serving_an_online_state_on_its_own_prompts_warns(tmp_path):
    from test_runner import _cfg as run_cfg

    from omnidraft.runner import check_config, run

    run(run_cfg(tmp_path / "s", "method=omnidraft", "task.limit=3", "decode.max_new_tokens=4"))
    meta = json.loads((tmp_path / "s" / "state" / "meta.json").read_text())
    assert meta["train_split"]["task"] == "synthetic" and meta["next_index"] == 3
    state = f"drafter.init_state={tmp_path / 's' / 'state'}"
    with pytest.warns(UserWarning, match=r"adapted online on synthetic prompts 0..2"):
        check_config(run_cfg(tmp_path / "a", "method=omnidraft", state, "task.offset=2", "task.limit=2"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_config(run_cfg(tmp_path / "b", "method=omnidraft", state, "task.offset=3", "task.limit=2"))


def test_hf_ar_is_transformers_plain_generate_and_equals_ar(pair_llama2_qwen, tmp_path):
    from test_runner import _cfg as run_cfg

    from omnidraft.runner import run

    target, ttok, *_ = pair_llama2_qwen
    eos = eos_of(ttok)
    eng = HFAssisted(target, None, ttok)
    for text in PROMPTS[:4]:
        ids = ttok.encode(text, add_special_tokens=True)
        ar = generate(target, ids, max_new_tokens=N_NEW, eos_ids=eos)
        res = eng.generate(ids, max_new_tokens=N_NEW, eos_ids=eos)
        assert res.tokens == ar.tokens
        assert len(res.steps) == res.n_new and all(s.proposed == 0 for s in res.steps)  # one forward a token
    s = run(run_cfg(tmp_path / "r", "method=hf_ar", "task.limit=2", "decode.max_new_tokens=8"))
    assert s["lossless/match_rate"] == 1.0 and s["drafter"] is None and s["accept/mean_len"] == 1.0


def test_bench_resumes_from_its_checkpoint_like_an_uninterrupted_bench(tmp_path, monkeypatch):
    """Includes a method served from drafter.init_state (distillspec), and resume=true given as the
    command line gives it (among the overrides the methods' configs are composed from)."""
    import omnidraft.bench as bench
    from omnidraft.distill_command import run_distill
    from omnidraft.errors import OmniDraftError

    run_distill(_cfg("distill", f"run_dir={tmp_path / 'd'}", "task.offset=6", "task.limit=2",
                     "distill.max_new_tokens=8", "progress=false"))
    methods = ["ar", "uag_k5", "osd", "distillspec", "omnidraft"]

    def cfg(name, *extra):
        cli = "overrides=['debug=tiny','resume=true']" if "resume=true" in extra else "overrides=['debug=tiny']"
        return _cfg("bench", cli, f"run_dir={tmp_path / name}", f"bench.out_dir={tmp_path / 'out'}",
                    f"bench.name={name}", "bench.tasks=[synthetic]", "bench.limit=5", "decode.max_new_tokens=10",
                    f"bench.methods=[{','.join(methods)}]", "method.adapt.interval=1", "progress=false",
                    "bench.method_overrides.osd=['method.adapt.interval=1']", "checkpoint_every=1",
                    f"bench.method_overrides.distillspec=['drafter.init_state={tmp_path / 'd' / 'state'}']", *extra)

    full = bench.run_bench(cfg("full"))
    real, calls = bench.rss_gib, {"n": 0}

    def crashing():
        calls["n"] += 1
        if calls["n"] == 2 * len(methods) + 2:  # inside prompt 2, after the checkpoint at 2
            raise RuntimeError("simulated crash")
        return real()

    monkeypatch.setattr(bench, "rss_gib", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        bench.run_bench(cfg("cut"))
    monkeypatch.setattr(bench, "rss_gib", real)
    resumed = bench.run_bench(cfg("cut", "resume=true"))
    assert resumed["resumed_at"] == 2 and resumed["n_prompts"] == full["n_prompts"] == 5
    keys = ("prompt/id", "sd/new_tokens", "sd/steps", "sd/proposed", "sd/accepted", "lossless/match")
    rows = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("full", "cut")}
    assert [{k: r[k] for k in ("method", *keys)} for r in rows["full"]] == \
        [{k: r[k] for k in ("method", *keys)} for r in rows["cut"]]
    for m in methods:
        for k in ("accept/rate", "accept/mean_len", "lossless/match_rate"):
            assert full["methods"][m][k] == resumed["methods"][m][k], (m, k)
    with pytest.raises(OmniDraftError, match="config differs"):
        bench.run_bench(cfg("cut", "resume=true", "decode.max_new_tokens=11"))
    with pytest.raises(OmniDraftError, match="no bench checkpoint"):
        bench.run_bench(cfg("fresh", "resume=true"))


def test_uag_heuristic_draft_length_is_part_of_the_saved_state(tmp_path):
    from test_runner import _cfg as run_cfg

    from omnidraft.runner import Session

    a = Session(run_cfg(tmp_path / "a", "method=uag_k5"))
    a.hf.assistant_config.num_assistant_tokens = 7  # where transformers' heuristic leaves it after a call
    st = a.state(3, [], {})
    b = Session(run_cfg(tmp_path / "b", "method=uag_k5"), target=a.target, draft=a.draft_lm)
    assert b.hf.assistant_config.num_assistant_tokens == 5
    b.restore(st)
    assert b.hf.assistant_config.num_assistant_tokens == 7


def test_bench_resume_is_not_passed_to_the_methods(tmp_path):
    """`omnidraft bench resume=true` resumes the bench's checkpoint; the methods' configs must not
    carry it, or a method with drafter.init_state (distillspec, a warmed omnidraft) is refused."""
    import omnidraft.bench as bench
    from omnidraft.errors import OmniDraftError
    from omnidraft.runner import check_config

    c = _cfg("bench", "overrides=['debug=tiny','resume=true','state_dir=x','seed=3']", f"run_dir={tmp_path}")
    base = bench._base_overrides(c)
    assert base == ["debug=tiny", "seed=3"]
    with pytest.raises(OmniDraftError, match="drop drafter.init_state"):  # what the filter prevents
        check_config(_cfg("config", "debug=tiny", "resume=true", f"drafter.init_state={tmp_path}"))


def test_bench_and_distill_log_to_wandb_offline_like_runs(tmp_path, monkeypatch):
    from omnidraft.bench import run_bench
    from omnidraft.distill_command import run_distill

    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_bench(_cfg("bench", "logger=default", f"run_dir={tmp_path / 'bench_run'}", f"bench.out_dir={tmp_path / 'out'}",
                   "bench.name=tiny", "bench.tasks=[synthetic]", "bench.limit=1", "decode.max_new_tokens=4",
                   "bench.methods=[ar,pld]", "progress=false"))
    assert list((tmp_path / "bench_run" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_distill(_cfg("distill", "logger=default", f"run_dir={tmp_path / 'distill_run'}", "task=synthetic",
                     "task.offset=0", "task.limit=2", "distill.max_new_tokens=4", "progress=false"))
    assert list((tmp_path / "distill_run" / "wandb").glob("offline-run-*/run-*.wandb"))
