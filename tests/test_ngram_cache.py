"""The n-gram cache: construction from real tokenizers, longest-match merge, eviction, state."""

from __future__ import annotations

import pytest

from omnidraft.drafting.direct_map import build_bridge
from omnidraft.drafting.ngram_cache import NgramCache, alignments


def _ids(tok, pieces):
    return [tok.convert_tokens_to_ids(p) for p in pieces]


def test_entries_for_words_that_split_differently(llama2_tok, qwen_tiny, cache_dir):
    qtok = qwen_tiny[1]
    b = build_bridge(llama2_tok, qtok, cache_dir)
    text = " The stamps were unbelievable"
    t_ids = qtok.encode(text, add_special_tokens=False)
    d_ids = llama2_tok.encode(text, add_special_tokens=False)
    # drop the SentencePiece dummy prefix so both spell exactly the same bytes
    if llama2_tok.convert_ids_to_tokens(d_ids[0]) == "▁":
        d_ids = d_ids[1:]
    assert b"".join(b.target_bytes[t] for t in t_ids) == b"".join(b.draft_bytes[d] for d in d_ids)
    pairs = alignments(t_ids, b.target_bytes, d_ids, b.draft_bytes)
    stamps = qtok.convert_tokens_to_ids("Ġstamps")
    assert (stamps, tuple(_ids(llama2_tok, ["▁st", "amps"]))) in pairs
    # every entry spells exactly its target token and has >= 2 sub-tokens
    for t, seq in pairs:
        assert len(seq) >= 2
        assert b"".join(b.draft_bytes[d] for d in seq) == b.target_bytes[t]
    # ' The' is one token on both sides: directly mapped, not an n-gram
    assert qtok.convert_tokens_to_ids("ĠThe") not in [t for t, _ in pairs]


def test_longest_match_merge():
    c = NgramCache()
    c.add(100, [1, 2])
    c.add(200, [1, 2, 3])
    direct = {1: 11, 2: 12, 3: 13, 4: 14}.get
    out = c.merge([1, 2, 3, 4, 1, 2, 9, 4], lambda d: direct(d, -1))
    assert [(m.target_id, m.start, m.end) for m in out] == [(200, 0, 3), (14, 3, 4), (100, 4, 6)]
    # 9 is neither mapped nor a hit: the proposal ends there
    assert out[-1].end == 6 and c.hits == 2


def test_unmapped_token_truncates_and_duplicates_are_ignored():
    c = NgramCache()
    assert c.add(5, [7, 8]) and not c.add(5, [7, 8]) and not c.add(6, [9])
    assert c.merge([3, 7, 8], lambda d: -1) == []
    assert len(c) == 1


@pytest.mark.parametrize("policy,evicted", [("lru", 101), ("lfu", 102)])
def test_eviction(policy, evicted):
    c = NgramCache(capacity=2, eviction=policy)
    c.add(101, [1, 2])
    c.add(102, [3, 4])
    c.merge([1, 2], lambda d: -1)  # use 101 once: most recent AND most frequent
    c.merge([3, 4], lambda d: -1)  # 102 now most recent; 101 and 102 used once each
    c.merge([1, 2], lambda d: -1)  # 101: most recent, used twice
    if policy == "lru":
        c.merge([3, 4], lambda d: -1)  # 102 most recent -> 101 is least recent
    c.add(103, [5, 6])
    assert len(c) == 2 and c.spelling(evicted) is None and c.spelling(103) == (5, 6)


def test_state_round_trip():
    c = NgramCache(capacity=10, eviction="lfu")
    c.add(1, [2, 3])
    c.add(4, [5, 6, 7])
    c.merge([5, 6, 7], lambda d: -1)
    d = NgramCache.from_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict() and len(d) == 2 and d.get([5, 6, 7]) == 4


@pytest.mark.parametrize("k", [3, 5])
def test_ngram_drafter_is_lossless_and_learns(pair_llama2_qwen, k):
    """Greedy output stays identical to ar with the cache on; the cache fills from accepted text
    and every entry spells its target token exactly."""
    from conftest import PROMPTS

    from omnidraft.core.decode import generate
    from omnidraft.drafting.model_drafters import NgramDrafter
    from omnidraft.learn.observers import step_observers

    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    for text in PROMPTS[:12]:
        ids = ttok.encode(text)
        ar = generate(target, ids, max_new_tokens=24)
        sd = generate(target, ids, drafter=d, k=k, max_new_tokens=24, observers=step_observers(d))
        assert sd.tokens == ar.tokens, text
    assert len(d.ngram) > 0
    for seq, t in d.ngram._by_seq.items():
        assert b"".join(bridge.draft_bytes[x] for x in seq) == bridge.target_bytes[t]


def test_accepted_ngram_proposals_keep_greedy_output_identical(pair_llama2_qwen):
    """The merge path itself under greedy verification: entries planted so that the drafter's own
    first two drafts merge into the target's greedy next token, which the target then accepts."""
    from conftest import PROMPTS

    from omnidraft.core.decode import generate
    from omnidraft.drafting.model_drafters import NgramDrafter

    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, learn=False)
    for text in PROMPTS[:8]:
        ids = ttok.encode(text)
        d.start(ids)
        drafts, *_ = d._draft(2, 0.0, None)
        t1 = generate(target, ids, max_new_tokens=1).tokens[0]
        if len(drafts) == 2 and d.ngram.get(drafts) is None and d.ngram.spelling(t1) is None:
            d.ngram.add(t1, drafts)
    d.refresh_mask()
    assert len(d.ngram) >= 3

    accepted_ngrams = 0

    class Count:  # an observer: accepted n-gram proposals per step
        def start(self, prompt_ids):
            pass

        def observe(self, fb):
            nonlocal accepted_ngrams
            accepted_ngrams += sum(m.is_ngram for m in fb.proposal.spans[:fb.n_accepted])

    for text in PROMPTS[:8]:
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=d, k=4, max_new_tokens=12, observers=[Count()]).tokens == \
            generate(target, ids, max_new_tokens=12).tokens, text
    assert d.hits_total >= 3 and accepted_ngrams >= 3  # merged proposals were verified and accepted
