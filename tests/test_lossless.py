"""Greedy speculative output equals greedy target output, token by token (fp32, tiny models)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, aligned_drafter, eos_of

from omnidraft.core.decode import generate
from omnidraft.drafting.model_drafters import DirectMapDrafter, SameVocabDrafter

N_NEW = 24


def _prompt(tok, text):
    return tok.encode(text, add_special_tokens=True)


_AR: dict = {}  # (target id, prompt) -> greedy ar tokens, shared across k


def _ar(target, ids, eos):
    key = (id(target), tuple(ids))
    if key not in _AR:
        _AR[key] = generate(target, ids, drafter=None, max_new_tokens=N_NEW, eos_ids=eos)
    return _AR[key]


def _check(target, ttok, make_drafter, k):
    eos = eos_of(ttok)
    accepted = proposed = 0
    for text in PROMPTS[:20]:
        ids = _prompt(ttok, text)
        ar = _ar(target, ids, eos)
        sd = generate(target, ids, drafter=make_drafter(), k=k, max_new_tokens=N_NEW, eos_ids=eos)
        assert sd.tokens == ar.tokens, f"k={k} prompt={text!r}"
        assert len(sd.tokens) <= N_NEW
        assert sum(s.emitted for s in sd.steps) == len(sd.tokens)
        assert all(s.proposed <= k for s in sd.steps)
        accepted += sd.accepted
        proposed += sd.proposed
    return accepted, proposed


@pytest.mark.parametrize("k", [1, 3, 5])
def test_same_vocab_sd_is_lossless(qwen_tiny, k):
    target, ttok = qwen_tiny
    # A drafter that is the target plus noise: agrees often, not always.
    from omnidraft.drafting.direct_map import build_bridge

    bridge = build_bridge(ttok, ttok)
    drafter = aligned_drafter(target, bridge, target.config.vocab_size, noise=0.3)
    acc, prop = _check(target, ttok, lambda: SameVocabDrafter(drafter, eos_of(ttok)), k)
    assert 0 < acc < prop  # both acceptance and rejection paths ran


@pytest.mark.parametrize("pair", ["pair_llama2_qwen", "pair_llama2_llama3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_cross_vocab_spd_dm_is_lossless(request, pair, k):
    target, ttok, drafter, dtok, bridge = request.getfixturevalue(pair)
    v_t = target.get_output_embeddings().weight.shape[0]
    make = lambda: DirectMapDrafter(drafter, dtok, bridge, v_t, eos_of(ttok))  # noqa: E731
    acc, prop = _check(target, ttok, make, k)
    print(f"{pair} k={k}: accepted {acc}/{prop}")
    assert acc > 0 and acc < prop


def test_max_new_tokens_and_eos_respected(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    v_t = target.get_output_embeddings().weight.shape[0]
    ids = _prompt(ttok, PROMPTS[0])
    ar = generate(target, ids, max_new_tokens=12)
    for n in (1, 2, 7):
        sd = generate(target, ids, drafter=DirectMapDrafter(drafter, dtok, bridge, v_t), k=5, max_new_tokens=n)
        assert sd.tokens == ar.tokens[:n]
    # Declare the 4th greedy token an EOS: both stop right after it.
    eos = {ar.tokens[3]}
    ar_e = generate(target, ids, max_new_tokens=12, eos_ids=eos)
    sd_e = generate(target, ids, drafter=DirectMapDrafter(drafter, dtok, bridge, v_t, eos), k=5,
                    max_new_tokens=12, eos_ids=eos)
    assert ar_e.tokens == sd_e.tokens == ar.tokens[: ar.tokens.index(ar.tokens[3]) + 1]
    assert sd_e.stop == "eos"


def test_sampling_seed_reproduces(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    v_t = target.get_output_embeddings().weight.shape[0]
    ids = _prompt(ttok, PROMPTS[1])

    def run(seed):
        d = DirectMapDrafter(drafter, dtok, bridge, v_t)
        return generate(target, ids, drafter=d, k=4, max_new_tokens=20, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed)).tokens

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_same_vocab_sd_with_differently_padded_vocabularies(qwen_tiny):
    """One tokenizer, embedding matrices of different sizes: the drafter never proposes an id the
    target's logits lack, greedy stays lossless, and sampling runs in the target's vocabulary."""
    from omnidraft.drafting.direct_map import build_bridge

    target, ttok = qwen_tiny
    v_t = target.config.vocab_size
    drafter = aligned_drafter(target, build_bridge(ttok, ttok), v_t + 64, noise=0.3)
    with torch.no_grad():
        drafter.lm_head.weight[v_t:] = drafter.lm_head.weight[:v_t].abs().max() * 50  # padding rows would win
    eos = eos_of(ttok)
    for text in PROMPTS[:3]:
        ids = ttok.encode(text)
        ar = generate(target, ids, max_new_tokens=12, eos_ids=eos)
        sd = generate(target, ids, drafter=SameVocabDrafter(drafter, eos, target_vocab_size=v_t), k=4,
                      max_new_tokens=12, eos_ids=eos)
        assert sd.tokens == ar.tokens and sd.proposed > 0
        out = generate(target, ids, drafter=SameVocabDrafter(drafter, eos, target_vocab_size=v_t), k=4,
                       max_new_tokens=12, eos_ids=eos, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert all(t < v_t for t in out.tokens)


def _lookup_check(target, ttok, make_drafter, k, observers=lambda d: ()):
    """Greedy output == ar on 20 prompts with the lookup consulted first; both sources ran, and
    each had accepted and rejected proposals."""
    eos = eos_of(ttok)
    by_source = {"lookup": [0, 0, 0], "model": [0, 0, 0]}  # accepted, proposed, longest proposal
    for i, text in enumerate(PROMPTS[:20]):
        ids = _prompt(ttok, text if i % 2 else text + " " + text)  # repeated text: lookups hit
        ar = _ar(target, ids, eos)
        d = make_drafter()
        seen = []

        class Spy:
            def start(self, prompt_ids):
                pass

            def observe(self, fb):
                seen.append((fb.proposal.source, len(fb.proposal.ids), fb.n_accepted))

        sd = generate(target, ids, drafter=d, k=k, max_new_tokens=N_NEW, eos_ids=eos,
                      observers=[*observers(d), Spy()])
        assert sd.tokens == ar.tokens, f"k={k} prompt={text!r}"
        for src, m, n in seen:
            by_source[src][0] += n
            by_source[src][1] += m
            by_source[src][2] = max(by_source[src][2], m)
        assert d.stats()["draft/lookup_steps"] == sum(s == "lookup" for s, _, _ in seen)
        assert [st.source for st in sd.steps] == [s for s, _, _ in seen]  # the step records say which source
    for src, (acc, prop, _) in by_source.items():
        assert 0 < acc < prop, (src, acc, prop)
    return by_source


@pytest.mark.parametrize("k", [3, 5])
def test_same_vocab_sd_with_prompt_lookup_first_is_lossless(qwen_tiny, k):
    from omnidraft.drafting.direct_map import build_bridge

    target, ttok = qwen_tiny
    drafter = aligned_drafter(target, build_bridge(ttok, ttok), target.config.vocab_size, noise=0.3)
    _lookup_check(target, ttok, lambda: SameVocabDrafter(drafter, eos_of(ttok), lookup_min_match=2), k)


@pytest.mark.parametrize("pair", ["pair_llama2_qwen", "pair_llama2_llama3"])
def test_cross_vocab_ngram_drafter_with_prompt_lookup_first_is_lossless(request, pair):
    """The n-gram cache keeps learning on every step (lookup steps included), and greedy output is
    the target's."""
    from omnidraft.drafting.model_drafters import NgramDrafter
    from omnidraft.learn.observers import step_observers

    target, ttok, drafter, dtok, bridge = request.getfixturevalue(pair)
    v_t = target.get_output_embeddings().weight.shape[0]
    made = []

    def make():
        made.append(NgramDrafter(drafter, dtok, bridge, v_t, eos_of(ttok), lookup_min_match=2, lookup_max_ngram=3, model_k=3))
        return made[-1]

    by_source = _lookup_check(target, ttok, make, 6, observers=lambda d: step_observers(d))
    assert any(len(d.ngram) for d in made)  # the cache builder ran
    # model_k caps the LM's drafts (an n-gram drafter merges them into <= 3 proposals), not the lookup's
    assert by_source["model"][2] <= 3 < by_source["lookup"][2]


@pytest.mark.parametrize("pair", ["same_vocab", "pair_llama2_qwen"])
def test_confidence_stop_with_prompt_lookup_is_lossless(request, pair):
    """policy=confidence (stop after an unsure drafter token) with the lookup consulted first: greedy
    output is the target's on 20 prompts, and the LM's draft lengths vary below the budget."""
    from omnidraft.drafting.direct_map import build_bridge
    from omnidraft.drafting.model_drafters import NgramDrafter
    from omnidraft.learn.draft_length import ConfidenceK
    from omnidraft.learn.observers import step_observers, use_length_policy

    made = []
    if pair == "same_vocab":
        target, ttok = request.getfixturevalue("qwen_tiny")
        drafter = aligned_drafter(target, build_bridge(ttok, ttok), target.config.vocab_size, noise=0.3)

        def make():
            made.append(SameVocabDrafter(drafter, eos_of(ttok), lookup_min_match=2, model_k=5))
            use_length_policy(made[-1], ConfidenceK(0.5))
            return made[-1]
    else:
        target, ttok, drafter, dtok, bridge = request.getfixturevalue(pair)
        v_t = target.get_output_embeddings().weight.shape[0]

        def make():
            made.append(NgramDrafter(drafter, dtok, bridge, v_t, eos_of(ttok), lookup_min_match=2, model_k=5))
            use_length_policy(made[-1], ConfidenceK(0.3))
            return made[-1]

    lengths = []

    class Lengths:
        def start(self, prompt_ids):
            pass

        def observe(self, fb):
            if fb.proposal.source == "model":
                lengths.append(len(fb.proposal.drafts))

    _lookup_check(target, ttok, make, 8, observers=lambda d: [*step_observers(d, policy=d.policy), Lengths()])
    assert min(lengths) < 5 and len(set(lengths)) > 1, sorted(set(lengths))
