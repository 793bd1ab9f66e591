"""Divergence certification: a bf16 near-tie is told apart from a real divergence."""

from __future__ import annotations

import torch

from omnidraft.core.certify import certify, first_divergence


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2


def _tied(model, prompt, a: int, b: int, gap: float):
    """A copy of ``model`` whose LM head gives tokens a and b, after ``prompt``, logits ``gap`` apart."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        out = m(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        head = m.get_output_embeddings().weight
        h = m.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1].float()
        top = float(out.max()) + 1.0
        # set rows a and b so that their logits are top and top - gap (least-squares along h)
        for tok, val in ((a, top), (b, top - gap)):
            row = head[tok].float()
            row += (val - float(row @ h)) * h / float(h @ h)
            head[tok] = row.to(head.dtype)
    return m


def test_a_gap_below_one_ulp_is_a_near_tie_and_a_wide_one_is_not(qwen_tiny):
    model, tok = qwen_tiny
    prompt = tok.encode("The quick brown fox")
    a, b = 100, 200
    near = _tied(model, prompt, a, b, gap=1e-7)  # fp32: eps 1.2e-7 x |top|
    got = certify(near, prompt, [b, 5], [a, 5])
    assert got["lossless/diverge_at"] == 0 and got["lossless/near_tie"], got
    far = _tied(model, prompt, a, b, gap=1.0)
    got = certify(far, prompt, [b, 5], [a, 5])
    assert not got["lossless/near_tie"] and got["lossless/gap_batched"] > got["lossless/resolution"]
    assert certify(far, prompt, [a, 5], [a, 5]) is None
