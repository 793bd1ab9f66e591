"""The transformers-shaped Python API: a decoder built from HF model and tokenizer objects gives
``target.generate(do_sample=False)``'s ids, and an exported drafter reloads with ``from_pretrained``
and serves the same proposals."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from omnidraft.api import from_models
from omnidraft.errors import OmniDraftError

PROMPTS = ["Hello there, how are", "def add(a, b):\n    return", "The capital of France is", "1, 2, 3, 4, 5,",
           "Once upon a time", "import numpy as np\n"]


def _ids(tok, text):
    return torch.tensor([tok.encode(text)], dtype=torch.long)


def _noisy_copy(model, seed: int, noise: float):
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return d


@pytest.mark.parametrize("method", ["omnidraft", "sd", "pld"])
def test_generate_equals_the_targets_greedy_generate(pair_llama2_qwen, method):
    target, ttok, drafter, dtok, _ = pair_llama2_qwen
    if method == "omnidraft":  # cross-vocabulary: a Llama-2-tokenizer drafter for a Qwen2 target
        dm, dtok = copy.deepcopy(drafter), dtok
    elif method == "sd":  # same tokenizer: a perturbed copy of the target
        dm, dtok = _noisy_copy(target, 3, 0.3), ttok
    else:
        dm = dtok = None
    dec = from_models(target, ttok, dm, dtok, method=method, overrides=["method.k=3"])
    proposed = accepted = 0
    for text in PROMPTS:
        ids = _ids(ttok, text)
        want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               pad_token_id=ttok.eos_token_id)
        got = dec.generate(ids, max_new_tokens=12)
        assert got.tolist() == want.tolist(), text
        proposed += dec.last_result.proposed
        accepted += dec.last_result.accepted
    if dm is not None:
        assert proposed > accepted > 0  # both accepts and rejects happened


def test_an_exported_drafter_reloads_with_from_pretrained_and_serves_the_same_proposals(tmp_path, pair_llama2_qwen):
    target, ttok, drafter, dtok, _ = pair_llama2_qwen
    dm = copy.deepcopy(drafter)
    dec = from_models(target, ttok, dm, dtok, method="omnidraft",
                      overrides=["method.k=3", "method.adapt.interval=1", "method.adapt.lr=1e-3"])
    for text in PROMPTS[:3]:  # adapts: three updates, and the n-gram cache learns
        dec.generate(_ids(ttok, text), max_new_tokens=12)
    assert dec.stats()["adapt/n_updates"] == 3 and dec.stats()["ngram/size"] > 0
    out = dec.save_pretrained(tmp_path / "drafter")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    rtok = PreTrainedTokenizerFast.from_pretrained(out)  # reads tokenizer.json as written
    probe = " hello\n  x = [1, 2]\n\tdef f():"
    assert rtok.encode(probe) == dtok.encode(probe)
    for (n, p), (n2, p2) in zip(dm.named_parameters(), reloaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n  # the adapted weights, not the initial ones
    served = from_models(target, ttok, reloaded, rtok, method="omnidraft",
                         overrides=["method.k=3", "method.adapt.enabled=false", f"drafter.init_state={out / 'omnidraft'}",
                                    "drafter.init_ngram=true"])
    assert served.stats()["ngram/size"] == dec.stats()["ngram/size"]
    for text in PROMPTS[3:]:
        ids = _ids(ttok, text)
        a, b = dec.generate(ids, max_new_tokens=12, adapt=False), served.generate(ids, max_new_tokens=12, adapt=False)
        assert a.tolist() == b.tolist()
        assert [(s.proposed, s.accepted) for s in dec.last_result.steps] == \
            [(s.proposed, s.accepted) for s in served.last_result.steps]


def test_bad_calls_are_refused_in_one_line(qwen_tiny):
    target, ttok = qwen_tiny
    with pytest.raises(OmniDraftError, match="drafts with a model"):
        from_models(target, ttok, method="omnidraft")
    dec = from_models(target, ttok, method="pld")
    with pytest.raises(OmniDraftError, match="batch of 2"):
        dec.generate(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(OmniDraftError, match="do_sample=True"):
        dec.generate(_ids(ttok, "hi"), do_sample=True)
