"""Adaptive draft length: stop rule, head training, losslessness whatever the lengths, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import PROMPTS

from omnidraft.core.decode import generate
from omnidraft.core.feedback import Proposal, StepFeedback
from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.learn.acceptance_head import AcceptanceHead, HeadLearner
from omnidraft.learn.draft_length import ConfidenceK, HeadPolicy, HeuristicK
from omnidraft.learn.observers import step_observers, use_length_policy


def _constant_head(hidden: int, p: float) -> AcceptanceHead:
    head = AcceptanceHead(hidden)
    with torch.no_grad():
        head.out.bias.fill_(math.log(p / (1 - p)))
    return head


def test_stop_rule_stops_where_the_product_crosses_gamma():
    class Given(torch.nn.Module):  # the "hidden state" carries the logit to predict
        def forward(self, h):
            return h[..., 0]

    def length(ps, gamma, k_min=1, k_max=16):
        pol = HeadPolicy(Given(), gamma=gamma, k_min=k_min, k_max=k_max)
        pol.begin()
        for n, p in enumerate(ps, 1):
            if not pol.keep_going(torch.tensor([math.log(p / (1 - p))])):
                return n
        return len(ps)

    ps = [0.9, 0.8, 0.7, 0.9, 0.9]  # 1 - prod: 0.10, 0.28, 0.496, 0.546, ...
    assert length(ps, 0.5) == 4
    assert length(ps, 0.49) == 3
    assert length(ps, 0.05) == 1
    assert length(ps, 0.05, k_min=2) == 2


def test_confidence_stops_after_the_first_unsure_token_and_keeps_it():
    def length(ps, min_prob, k_min=1):
        pol = ConfidenceK(min_prob, k_min=k_min)
        pol.begin()
        for n, p in enumerate(ps, 1):
            if not pol.keep_going(None, p):
                return n
        return len(ps)

    ps = [0.9, 0.6, 0.3, 0.95, 0.2]
    assert length(ps, 0.4) == 3  # 0.3 < 0.4: the third token is proposed, drafting stops
    assert length(ps, 0.65) == 2
    assert length(ps, 0.1) == 5
    assert length(ps, 0.65, k_min=3) == 3
    with pytest.raises(ValueError, match="min_prob"):
        ConfidenceK(1.5)


def test_heuristic_schedule():
    h = HeuristicK(k_start=5, k_min=1, k_max=8)
    h.update(5, 5)
    assert h.k == 7
    h.update(7, 7)
    assert h.k == 8
    h.update(8, 2)
    assert h.k == 7 and h.max_len(3) == 3


def test_head_loss_drops_on_a_fixed_batch():
    g = torch.Generator().manual_seed(0)
    head = AcceptanceHead(16)
    learner = HeadLearner(head, mode="joint", lr=1e-2, batch_size=16)
    hidden = torch.randn(64, 16, generator=g)
    labels = (hidden[:, 0] > 0).float().tolist()  # learnable from the hidden state
    items = [(hidden[i: i + 1], labels[i]) for i in range(64)]
    with torch.no_grad():
        before = float(learner.loss(items))
    for _ in range(20):
        learner.buffer.extend(items)
        learner.update()
    with torch.no_grad():
        after = float(learner.loss(items))
    assert after < 0.7 * before


def test_weighted_bce_predicts_low_by_design_and_debiasing_recovers_the_rate():
    """With mismatch weight w the BCE minimiser for acceptance rate y is y / (y + w (1 - y)) (0.28 for
    y = 0.7, w = 6); head/pred_accept_debiased inverts it back to ~0.7."""
    head = AcceptanceHead(8)
    learner = HeadLearner(head, mode="joint", lr=5e-2, batch_size=100, mismatch_weight=6.0)
    h = torch.ones(1, 8)
    items = [(h, 1.0 if i < 70 else 0.0) for i in range(100)]
    for _ in range(300):
        learner.buffer.extend(items)
        learner.update()
    learner.record(h.repeat(100, 1), [(i, i + 1) for i in range(100)], [y for _, y in items],
                   [y == 1.0 for _, y in items])
    cal = learner.calibration()
    assert cal["head/obs_accept"] == pytest.approx(0.7)
    assert cal["head/pred_accept"] == pytest.approx(0.7 / (0.7 + 6 * 0.3), abs=0.02)
    assert cal["head/pred_accept_debiased"] == pytest.approx(0.7, abs=0.02)


@pytest.mark.parametrize("policy", ["head", "heuristic", "confidence"])
def test_lossless_whatever_lengths_the_policy_picks(pair_llama2_qwen, policy):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    lengths = set()
    if policy == "head":
        learner = HeadLearner(AcceptanceHead(drafter.config.hidden_size), mode="interleaved", lr=1e-2)
        use_length_policy(d, HeadPolicy(learner.head, gamma=0.6, k_max=8))
        obs = step_observers(d, policy=d.policy, head=learner)
    else:
        use_length_policy(d, HeuristicK(k_start=2, k_max=8) if policy == "heuristic" else ConfidenceK(0.3))
        obs = step_observers(d, policy=d.policy)
    for text in PROMPTS[:6]:
        ids = ttok.encode(text)
        sd = generate(target, ids, drafter=d, k=8, max_new_tokens=20, observers=obs)
        assert sd.tokens == generate(target, ids, max_new_tokens=20).tokens
        lengths |= {s.proposed for s in sd.steps}
        if policy == "head":
            assert learner.update()["head/loss"] > 0
    assert len(lengths) > 1  # the lengths did vary


class _Spy(HeadLearner):
    """Keeps every recorded (labels, accepted) pair."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[list[float], list[bool]]] = []

    def record(self, hidden, groups, labels, accepted):
        self.seen.append((list(labels), list(accepted)))
        super().record(hidden, groups, labels, accepted)


@pytest.mark.parametrize("label", ["verify", "t1"])
def test_greedy_head_labels_follow_verification(pair_llama2_qwen, label):
    """Under greedy verification 'verify' labels are exactly the accept outcomes (1 for accepted
    proposals, 0 for the first rejection); 't1' labels are T=1 ratios, which differ from them."""
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    spy = _Spy(AcceptanceHead(drafter.config.hidden_size), mode="joint", label=label)
    use_length_policy(d, HeadPolicy(spy.head, gamma=0.9, k_max=6))
    obs = step_observers(d, policy=d.policy, head=spy)
    for text in PROMPTS[:4]:
        generate(target, ttok.encode(text), drafter=d, k=6, max_new_tokens=16, observers=obs)
    pairs = [(y, float(a)) for labels, acc in spy.seen for y, a in zip(labels, acc)]
    assert pairs and any(a == 0 for _, a in pairs) and any(a == 1 for _, a in pairs)
    if label == "verify":
        assert all(y == a for y, a in pairs)
    else:
        assert any(y != a for y, a in pairs) and all(0 <= y <= 1 for y, _ in pairs)


def test_a_verification_without_proposals_feeds_nothing(pair_llama2_qwen):
    """The loop's last step of a length-capped generation proposes nothing (budget 0): neither the
    head nor the draft-length schedule may see the previous step's proposals again."""
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    spy = _Spy(AcceptanceHead(drafter.config.hidden_size), mode="joint")
    use_length_policy(d, HeuristicK(k_start=4, k_max=8))
    obs = step_observers(d, policy=d.policy, head=spy)

    def step(prop, new, n, rows):  # what the decode loop does after verifying
        fb = StepFeedback(prop, rows, n, new, 0.0, d.commit(new, n))
        for o in obs:
            o.observe(fb)

    ids = ttok.encode(PROMPTS[1])
    d.start(ids)
    prop = d.propose(4, 0.0, None)
    logits = target(input_ids=torch.tensor([ids + prop.ids])).logits[0, len(ids) - 1:]
    n = 0
    while n < len(prop.ids) and int(logits[n].argmax()) == prop.ids[n]:
        n += 1
    step(prop, prop.ids[:n] + [int(logits[n].argmax())], n, logits)
    k_after, n_seen = d.policy.k, len(spy.seen)
    assert n_seen == 1
    step(Proposal([]), [int(logits[n].argmax())], 0, logits[:1])  # a verification of the pending token alone
    assert d.policy.k == k_after and len(spy.seen) == n_seen
    for m in range(1, 8):  # and through the loop: a last step with budget 0 happens for some length
        before = len(spy.seen)
        res = generate(target, ids, drafter=d, k=4, max_new_tokens=m, observers=obs)
        assert len(spy.seen) - before == sum(1 for st in res.steps if st.proposed > 0)


def test_constant_head_drafts_the_predicted_length(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    use_length_policy(d, HeadPolicy(_constant_head(drafter.config.hidden_size, 0.8), gamma=0.5))
    for text in PROMPTS[:5]:
        d.start(ttok.encode(text))
        d.propose(16, 0.0, None)
        # 1 - 0.8^3 = 0.488 <= 0.5 < 1 - 0.8^4: four drafter tokens (fewer only at an EOS)
        assert len(d.last_drafts) == 4 or d._to_target(d.last_drafts[-1]) == ttok.eos_token_id


@pytest.mark.parametrize("mode,n_updates", [("interleaved", 5), ("joint", 1)])
def test_head_state_saves_and_resumes(tmp_path, monkeypatch, mode, n_updates):
    """Interleaved: the head's replay buffer and optimiser; joint (update every 3 prompts,
    checkpoints every 2): the learner's unflushed examples with their head labels."""
    from test_runner import _SAME, _cfg, _rows, run_until_crash

    from omnidraft.runner import run

    over = (f"ablation=adaptive_{mode}", f"method.adapt.interval={2 if mode == 'interleaved' else 3}",
            "task.limit=5", "decode.max_new_tokens=12", "checkpoint_every=2", "method.draft_length.k_max=6")
    full = run(_cfg(tmp_path / "full", *over))
    run_until_crash(monkeypatch, _cfg(tmp_path / "cut", *over), at_row=4)
    resumed = run(_cfg(tmp_path / "cut", *over, "resume=true"))
    keys = _SAME + ("draft/mean_len", "head/loss", "head/pred_accept", "head/obs_accept")
    for a, b in zip(_rows(tmp_path / "full"), _rows(tmp_path / "cut"), strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    assert full["draft/mean_len"] == resumed["draft/mean_len"] and "head/pred_accept" in full
    meta = json.loads((tmp_path / "cut" / "state" / "meta.json").read_text())
    assert meta["head"]["n_updates"] == n_updates


def test_a_trained_head_serves_the_next_stream_frozen_with_its_own_gamma(tmp_path):
    from test_runner import _cfg, _rows

    from omnidraft import state as state_io
    from omnidraft.errors import OmniDraftError
    from omnidraft.runner import run

    over = ("ablation=adaptive_joint", "method.adapt.interval=2", "task.limit=4", "decode.max_new_tokens=12",
            "method.draft_length.k_max=8")
    run(_cfg(tmp_path / "train", *over))
    saved = state_io.load(tmp_path / "train" / "state")
    serve = (*over, f"drafter.init_state={tmp_path / 'train' / 'state'}", "method.draft_length.head_learn=false")
    tight = run(_cfg(tmp_path / "tight", *serve, "method.draft_length.gamma_infer=0.05"))
    loose = run(_cfg(tmp_path / "loose", *serve, "method.draft_length.gamma_infer=0.95"))
    for name in ("tight", "loose"):
        served = state_io.load(tmp_path / name / "state")
        heads = [k for k in saved.tensors if k.startswith("head.")]
        assert heads and all(torch.equal(saved.tensors[k], served.tensors[k]) for k in heads)  # frozen
        rows = _rows(tmp_path / name)
        assert all("head/loss" not in r for r in rows) and all("head/pred_accept" in r for r in rows)
    assert loose["draft/mean_len"] > tight["draft/mean_len"]
    with pytest.raises(OmniDraftError, match="gamma_infer"):
        run(_cfg(tmp_path / "bad", *over, "method.draft_length.gamma_infer=0.5"))  # the head still learns
    with pytest.raises(OmniDraftError, match="head_learn=false serves a trained head"):
        run(_cfg(tmp_path / "bad2", *over, "method.draft_length.head_learn=false"))


@pytest.mark.parametrize("kind", ["spd_dm", "omnidraft"])
def test_warm_up_leaves_the_draft_length_state_as_it_was(pair_llama2_qwen, kind):
    from omnidraft.drafting.model_drafters import DirectMapDrafter

    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    cls = DirectMapDrafter if kind == "spd_dm" else NgramDrafter
    d = cls(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    use_length_policy(d, HeuristicK(k_start=9, k_min=1, k_max=16))
    obs = step_observers(d, policy=d.policy)
    ids = ttok.encode(PROMPTS[0])
    with d.paused():  # a warm-up: the loop runs without observers, the drafter's counters are put back
        warm = generate(target, ids, drafter=d, k=16, max_new_tokens=12)
    assert d.policy.k == 9 and d.drafted_total == 0  # the warm-up left the schedule and counters as they were
    res = generate(target, ids, drafter=d, k=16, max_new_tokens=12, observers=obs)
    assert warm.steps[0].proposed == res.steps[0].proposed  # the first step drafted the same either way
    assert d.policy.k != 9 and d.drafted_total > 0  # outside warm-up the schedule moves


def test_the_gamma_preset_follows_each_prompts_task(tmp_path):
    """Mixed streams and the bench decode several tasks in one session: a preset gamma follows the
    prompt's task, an explicit gamma stays."""
    from test_runner import _cfg

    from omnidraft.runner import Session

    sess = Session(_cfg(tmp_path / "a", "ablation=adaptive_joint"))
    for task, gamma in (("alpaca", 0.3), ("gsm8k", 0.7), ("xsum", 0.3), ("humaneval", 0.7)):
        sess.set_task(task)
        assert sess.drafter.policy.gamma == gamma
    fixed = Session(_cfg(tmp_path / "b", "ablation=adaptive_joint", "method.draft_length.gamma=0.5"))
    fixed.set_task("alpaca")
    assert fixed.drafter.policy.gamma == 0.5


class _HiddenSpy(HeadLearner):
    """Keeps every recorded step's drafting hidden states, spans and labels."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps: list[tuple[torch.Tensor, list, list[float]]] = []

    def record(self, hidden, groups, labels, accepted):
        self.steps.append((hidden.clone(), list(groups), list(labels)))
        super().record(hidden, groups, labels, accepted)


def _joint_setup(pair, lr=1e-2):
    from conftest import aligned_drafter

    from omnidraft.learn.online import OnlineLearner

    target, ttok, _, dtok, bridge = pair
    drafter = aligned_drafter(target, bridge, len(dtok), seed=11, noise=0.2)  # own copy: it trains
    learner = OnlineLearner(drafter, bridge, lr=1e-3, weight_decay=0.0, batch_size=4)
    spy = _HiddenSpy(AcceptanceHead(drafter.config.hidden_size), mode="joint", lr=lr)
    learner.attach_head(spy)
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    use_length_policy(d, HeadPolicy(spy.head, gamma=0.9, k_max=6))
    obs = step_observers(d, policy=d.policy, head=spy, learner=learner)
    for text in PROMPTS[:3]:
        generate(target, ttok.encode(text), drafter=d, k=6, max_new_tokens=16, observers=obs)
    return drafter, learner, spy


def test_joint_head_trains_on_the_hidden_states_it_drafted_with(pair_llama2_qwen):
    """A jointly trained head's examples carry each step's spans and labels, and the training
    copy's hidden states at the drafted positions equal the ones the head read while drafting."""
    drafter, learner, spy = _joint_setup(pair_llama2_qwen)
    assert not spy.buffer  # trained inside the learner, not from its own buffer
    exs = [ex for ex in learner.buffer if ex.head]
    assert len(exs) == len(spy.steps) > 5
    _, hidden = learner._draft_logits(exs)
    for ex, h, (rec, groups, labels) in zip(exs, hidden, spy.steps, strict=True):
        assert [(a, b) for a, b, _ in ex.head] == groups and [y for _, _, y in ex.head] == labels
        torch.testing.assert_close(h, rec[: len(ex.drafts)], atol=1e-4, rtol=1e-4)


def test_joint_update_backpropagates_the_head_loss_into_the_drafter(pair_llama2_qwen):
    """With no distillation signal at all (no directly mapped or n-gram positions), a joint update
    still moves the drafter: the head's loss reaches it through the hidden states. It moves the
    head too, and reports head/loss."""
    import dataclasses

    drafter, learner, spy = _joint_setup(pair_llama2_qwen)
    learner.buffer = [dataclasses.replace(ex, dm_pos=[], dm_logp=ex.dm_logp[:0], dm_top=[], ngrams=[])
                      for ex in learner.buffer if ex.head]
    before = [p.detach().clone() for p in drafter.parameters()]
    head_before = [p.detach().clone() for p in spy.head.parameters()]
    with torch.no_grad():
        loss0 = float(learner.losses(learner.buffer)["loss_head"])
    saved = list(learner.buffer)
    out = learner.update(progress=False)
    assert out["head/loss"] > 0 and out["head/n_updates"] == 1 == spy.n_updates
    assert out["adapt/loss"] == out["adapt/loss_dm"] == out["adapt/loss_ngram"] == 0  # adapt/loss: L_distill only
    assert any(not torch.equal(a, b) for a, b in zip(before, drafter.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(head_before, spy.head.parameters()))
    with torch.no_grad():
        assert float(learner.losses(saved)["loss_head"]) < loss0


def test_a_frozen_joint_head_takes_no_part_in_the_update(pair_llama2_qwen):
    """An attached head that is not learning adds no loss term: with no distillation signal the
    update moves nothing, and the head gathers no gradient."""
    import dataclasses

    drafter, learner, spy = _joint_setup(pair_llama2_qwen)
    spy.learn = False
    learner.buffer = [dataclasses.replace(ex, dm_pos=[], dm_logp=ex.dm_logp[:0], dm_top=[], ngrams=[])
                      for ex in learner.buffer if ex.head]
    before = [p.detach().clone() for p in drafter.parameters()]
    head_before = [p.detach().clone() for p in spy.head.parameters()]
    out = learner.update(progress=False)
    assert "head/loss" not in out and spy.n_updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, drafter.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(head_before, spy.head.parameters()))
    assert all(p.grad is None for p in spy.head.parameters())


def test_warm_up_leaves_a_capped_ngram_cache_as_it_was(pair_llama2_qwen):
    """Merging touches cache entries (lookup counts, LRU / LFU order): a warm-up drafts on a copy,
    so a resumed stream's cache (or one served with drafter.init_ngram) is exactly as saved."""
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, capacity=6,
                     eviction="lfu")
    obs = step_observers(d)
    for text in PROMPTS[:6]:
        generate(target, ttok.encode(text), drafter=d, k=5, max_new_tokens=24, observers=obs)
    assert len(d.ngram) > 0
    before = d.state_dict()
    with d.paused():
        for text in PROMPTS[6:9]:
            generate(target, ttok.encode(text), drafter=d, k=5, max_new_tokens=24)
    assert d.state_dict() == before


def test_the_head_learns_with_a_direct_map_drafter_too(pair_llama2_qwen):
    """Every model drafter's proposals carry their spans, so the acceptance head records (and its
    calibration is reported) with spd_dm / sd drafters as with the n-gram drafter."""
    from omnidraft.drafting.model_drafters import DirectMapDrafter

    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = DirectMapDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    learner = HeadLearner(AcceptanceHead(drafter.config.hidden_size), mode="interleaved", lr=1e-2)
    use_length_policy(d, HeadPolicy(learner.head, gamma=0.6, k_max=8))
    for text in PROMPTS[:3]:
        generate(target, ttok.encode(text), drafter=d, k=8, max_new_tokens=16,
                 observers=step_observers(d, policy=d.policy, head=learner))
    assert learner.calibration()["head/n"] > 0 and learner.update()["head/loss"] > 0


def test_cost_policy_picks_the_length_with_most_tokens_per_second():
    """With verification as dear as n plain steps nothing pays (a plain step: 0); with a flat
    verification cost and free drafting, the whole budget; in between, as the counts say."""
    from omnidraft.learn.draft_length import CostK

    linear = CostK(lambda n: 1.0 * n, lambda n: 0.0, k_max=8, explore_every=0, prior=0.9)
    assert linear.max_len(8) == 0  # j + 1 tokens in (1 + sum h^i) < j + 1 seconds: never better
    flat = CostK(lambda n: 1.0, lambda n: 0.0, k_max=8, explore_every=0, prior=0.5)
    assert flat.max_len(8) == 8 and flat.max_len(3) == 3
    # verify(n) = 1 + 0.1 (n - 1), a drafted token 0.05 s: position 1 accepted 9 times in 10, the
    # second 1 in 9: expected tokens j=1: 1 + .83 (with the prior pseudo-counts) over 1.15 s beats j=0 and j=2
    mid = CostK(lambda n: 1.0 + 0.1 * (n - 1), lambda n: 0.05, k_max=8, explore_every=0, prior=0.5)
    for i in range(10):
        mid.observe(StepFeedback(Proposal([1, 2], source="model"), None, 2 if i == 0 else (1 if i < 9 else 0), [], 0.0))
    assert mid.counts["model"] == [[9.0, 10.0], [1.0, 9.0]]
    assert mid.max_len(8) == 1
    exploring = CostK(lambda n: 1.0 * n, lambda n: 0.0, k_max=8, explore_every=4)
    picks = []
    for _ in range(8):
        picks.append(exploring.max_len(5))
        exploring.observe(StepFeedback(Proposal([1] * picks[-1]), None, 0, [], 0.0))
    assert picks == [0, 0, 0, 5, 0, 0, 0, 5]


def test_cost_policy_with_prompt_lookup_is_lossless_and_deterministic(pair_llama2_qwen):
    """A step may draft nothing (a plain target step), lookup proposals or the LM's; greedy output
    is the target's whatever it picks, and two runs pick the same (no wall-clock input)."""
    from omnidraft.learn.draft_length import CostK

    target, ttok, drafter, dtok, bridge = pair_llama2_qwen

    def run():
        d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, lookup_min_match=2)
        use_length_policy(d, CostK(lambda n: 1.0 + 0.3 * (n - 1), lambda n: 0.05, k_max=8, explore_every=3))
        obs = step_observers(d, policy=d.policy)
        steps = []
        for text in PROMPTS[:8]:
            ids = ttok.encode(text + " " + text)
            sd = generate(target, ids, drafter=d, k=8, max_new_tokens=20, observers=obs)
            assert sd.tokens == generate(target, ids, max_new_tokens=20).tokens
            steps += [(s.proposed, s.accepted) for s in sd.steps]
        return steps, d.policy.counts

    a, counts = run()
    assert run() == (a, counts)
    assert any(p == 0 for p, _ in a) and any(p > 0 for p, _ in a)
    assert "model" in counts and any(k.startswith("lookup") for k in counts)
