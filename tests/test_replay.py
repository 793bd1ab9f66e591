"""Greedy replay from a target trajectory (the verifier seam's second implementation): the same
decode loop, drafters and observers, no target forward, and the same steps as live verification."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, eos_of

from omnidraft.core.decode import generate
from omnidraft.core.verifiers import TraceVerifier
from omnidraft.drafting.model_drafters import DirectMapDrafter, NgramDrafter
from omnidraft.drafting.prompt_lookup import PromptLookupDrafter
from omnidraft.errors import OmniDraftError
from omnidraft.learn.draft_length import HeuristicK
from omnidraft.learn.observers import step_observers, use_length_policy
from omnidraft.learn.online import OnlineLearner

N_NEW = 24


def _drafter(kind, target, ttok, drafter, dtok, bridge):
    eos, v_t = eos_of(ttok), target.config.vocab_size
    if kind == "pld":
        return PromptLookupDrafter(v_t, eos), []
    if kind == "spd_dm":
        return DirectMapDrafter(drafter, dtok, bridge, v_t, eos), []
    if kind == "lookup_cost":  # prompt lookup first, draft lengths (0 included) from modelled costs
        from omnidraft.learn.draft_length import CostK

        d = NgramDrafter(drafter, dtok, bridge, v_t, eos, lookup_min_match=2)
        use_length_policy(d, CostK(lambda n: 1.0 + 0.3 * (n - 1), lambda n: 0.05, k_max=8, explore_every=3))
        return d, step_observers(d, policy=d.policy)
    d = NgramDrafter(drafter, dtok, bridge, v_t, eos)  # cache_pp: the n-gram cache learns, the drafter is frozen
    if kind == "cache_pp_heuristic":
        use_length_policy(d, HeuristicK(k_start=2, k_max=8))
        return d, step_observers(d, policy=d.policy)
    return d, step_observers(d)


def _steps(res):
    return [(s.proposed, s.accepted, s.emitted) for s in res.steps]


@pytest.mark.parametrize("kind", ["spd_dm", "pld", "cache_pp", "cache_pp_heuristic", "lookup_cost"])
def test_replay_equals_live_step_for_step(pair_llama2_qwen, kind):
    """20 prompts through one drafter each (its n-gram cache and schedule carry across prompts):
    every step's (proposed, accepted, emitted) and every token equal between live and replay."""
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    eos = eos_of(ttok)
    prompts = [ttok.encode(t) for t in PROMPTS[:20]]
    trace = {tuple(ids): generate(target, ids, max_new_tokens=N_NEW, eos_ids=eos).tokens for ids in prompts}
    live_d, live_obs = _drafter(kind, target, ttok, drafter, dtok, bridge)
    rep_d, rep_obs = _drafter(kind, target, ttok, drafter, dtok, bridge)
    replay = TraceVerifier(trace)
    accepted = 0
    for ids in prompts:
        k = 8 if kind in ("cache_pp_heuristic", "lookup_cost") else 5
        live = generate(target, ids, drafter=live_d, k=k, max_new_tokens=N_NEW, eos_ids=eos, observers=live_obs)
        rep = generate(replay, ids, drafter=rep_d, k=k, max_new_tokens=N_NEW, eos_ids=eos, observers=rep_obs)
        assert rep.tokens == live.tokens == trace[tuple(ids)]
        assert _steps(rep) == _steps(live)
        accepted += live.accepted
    assert accepted > 0  # the acceptance path ran
    if kind == "lookup_cost":
        assert live_d.policy.counts == rep_d.policy.counts
    if kind.startswith("cache_pp") or kind == "lookup_cost":
        assert live_d.ngram.state_dict() == rep_d.ngram.state_dict() and len(rep_d.ngram) > 0


def test_replay_refuses_sampling_missing_prompts_a_short_trace_and_learners(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    ids = ttok.encode(PROMPTS[0])
    out = generate(target, ids, max_new_tokens=8).tokens
    d = DirectMapDrafter(drafter, dtok, bridge, target.config.vocab_size)
    replay = TraceVerifier({tuple(ids): out})
    with pytest.raises(OmniDraftError, match="greedily only"):
        generate(replay, ids, drafter=d, k=4, max_new_tokens=8, temperature=0.7)
    with pytest.raises(OmniDraftError, match="no trajectory for this prompt"):
        generate(replay, ttok.encode(PROMPTS[1]), drafter=d, k=4, max_new_tokens=8)
    with pytest.raises(OmniDraftError, match="trace ends after 8 tokens"):
        generate(replay, ids, drafter=None, max_new_tokens=12)
    learner = OnlineLearner(drafter, bridge)
    nd = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size)
    with pytest.raises(OmniDraftError, match="online distillation learns from the target's distributions"):
        generate(replay, ids, drafter=nd, k=4, max_new_tokens=8, observers=step_observers(nd, learner=learner))
