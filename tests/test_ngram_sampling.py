"""OmniDraft's sampling rule with the n-gram cache (method.verify=paper) on tiny models with real,
different tokenizers: q' of a merged token is the product of the drafter's conditionals."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from omnidraft.core.decode import generate
from omnidraft.core.verify import lift_to_target
from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.errors import OmniDraftError
from omnidraft.learn.observers import step_observers

TEMP = 0.3
SHARP = 0.05  # the tiny drafter is flat: a low temperature makes samples revisit planted n-grams


@pytest.fixture(scope="module")
def warm(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, verify="paper")
    for text in PROMPTS[:12]:  # fill the cache greedily
        generate(target, ttok.encode(text), drafter=d, k=4, max_new_tokens=24, observers=step_observers(d))
    assert len(d.ngram) > 0
    return d


class Recorder:
    """Delegates to an NgramDrafter and keeps (context, drafts, merged, proposal) of each step."""

    def __init__(self, d):
        self.d, self.log = d, []

    def start(self, ids):
        self.d.start(ids)

    def propose(self, k, temperature, generator):
        ctx = list(self.d.ids)
        prop = self.d.propose(k, temperature, generator)
        self.log.append((ctx, self.d.last_drafts, self.d.last_merged, prop))
        return prop

    def commit(self, new, n):
        return self.d.commit(new, n)


def _planted(pair, n_prompts=6):
    """A drafter whose cache holds its own greedy 2-token drafts after a few prompts (mapped to the
    target token with the same bytes when there is one), so that low-temperature samples hit them."""
    target, ttok, drafter, dtok, bridge = pair
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, verify="paper")
    t_by_bytes = {b: i for i, b in enumerate(bridge.target_bytes) if b}
    spare = iter(range(target.config.vocab_size - 1, 0, -1))
    for text in PROMPTS[:n_prompts]:
        d.start(ttok.encode(text))
        drafts, *_ = d._draft(2, 0.0, None)
        if len(drafts) == 2:
            t = t_by_bytes.get(bridge.draft_bytes[drafts[0]] + bridge.draft_bytes[drafts[1]])
            while t is None or d.ngram.spelling(t) is not None:
                t = next(spare)
            d.ngram.add(t, drafts)
    d.refresh_mask()
    return d


def test_q_prime_is_the_product_of_drafter_conditionals(pair_llama2_qwen):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = _planted(pair_llama2_qwen)
    map_ids = torch.nonzero(bridge.draft_mask).squeeze(1)
    g = torch.Generator().manual_seed(0)
    n_ngram = 0
    for text in PROMPTS[:6] * 3:
        d.start(ttok.encode(text))
        ctx = list(d.ids)
        prop = d.propose(4, SHARP, g)
        drafts, merged = d.last_drafts, d.last_merged
        if not any(m.is_ngram for m in merged):
            continue
        with torch.no_grad():  # each conditional recomputed by a fresh full forward (no KV cache)
            q = [torch.softmax((drafter(input_ids=torch.tensor([ctx + drafts[:j]])).logits[0, -1].float()
                                + d._mask_add) / SHARP, -1) for j in range(len(drafts))]
        for i, m in enumerate(merged):
            lifted = lift_to_target(q[m.start], map_ids, bridge.d2t[map_ids], target.config.vocab_size)
            if not m.is_ngram:
                assert torch.allclose(prop.q[i], lifted, atol=1e-5)
                continue
            prod = 1.0
            for j in range(m.start, m.end):
                prod *= float(q[j][drafts[j]])
            t = prop.ids[i]
            assert float(prop.q[i, t]) == pytest.approx(float(lifted[t]) + prod, rel=1e-3, abs=1e-7)
            first = bridge.to_target(drafts[m.start])
            if first >= 0:
                assert float(prop.q[i, first]) == pytest.approx(max(0.0, float(lifted[first]) - prod),
                                                                rel=1e-3, abs=1e-6)
            n_ngram += 1
    assert n_ngram >= 3, "too few n-grams sampled to check the rule"


def test_paper_mode_samples_and_lossless_mode_refuses_sampling(pair_llama2_qwen, warm):
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    ids = ttok.encode(PROMPTS[0])
    res = generate(target, ids, drafter=warm, k=4, max_new_tokens=16, temperature=TEMP,
                   generator=torch.Generator().manual_seed(1), observers=step_observers(warm))
    assert res.n_new == 16 and 0 <= res.accepted <= res.proposed
    strict = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, verify="lossless")
    with pytest.raises(OmniDraftError, match="verify=paper"):
        generate(target, ids, drafter=strict, k=4, max_new_tokens=4, temperature=TEMP)


def test_paper_mode_at_temperature_zero_is_the_greedy_test(pair_llama2_qwen, warm):
    target, ttok, *_ = pair_llama2_qwen
    for text in PROMPTS[12:16]:
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=warm, k=4, max_new_tokens=16, observers=step_observers(warm)).tokens == \
            generate(target, ids, max_new_tokens=16).tokens
