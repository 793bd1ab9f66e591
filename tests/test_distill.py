"""Distillation losses on hand-computed examples."""

from __future__ import annotations

import math

import torch

from omnidraft.learn.losses import forward_kl, hybrid_loss, jsd, lifted_log_probs, ngram_nll, reverse_kl, tvd

P = torch.tensor([[0.5, 0.3, 0.2]])
Q = torch.tensor([[0.2, 0.2, 0.6]])


def test_divergences_on_a_three_token_example():
    lp, lq = P.log(), Q.log()
    rkl = sum(q * math.log(q / p) for p, q in zip(P[0].tolist(), Q[0].tolist()))
    fkl = sum(p * math.log(p / q) for p, q in zip(P[0].tolist(), Q[0].tolist()))
    m = [(p + q) / 2 for p, q in zip(P[0].tolist(), Q[0].tolist())]
    js = 0.5 * sum(p * math.log(p / mm) for p, mm in zip(P[0].tolist(), m)) + \
        0.5 * sum(q * math.log(q / mm) for q, mm in zip(Q[0].tolist(), m))
    assert math.isclose(reverse_kl(lq, lp).item(), rkl, rel_tol=1e-5)   # 0.3348...
    assert math.isclose(forward_kl(lp, lq).item(), fkl, rel_tol=1e-5)   # 0.3191...
    assert math.isclose(jsd(lp, lq, 0.5).item(), js, rel_tol=1e-5)
    assert math.isclose(tvd(lp, lq).item(), 0.4, rel_tol=1e-6)          # 0.5*(0.3+0.1+0.4)
    assert reverse_kl(lp, lp).abs().item() < 1e-7


def test_lifted_log_probs_adds_drafter_ids_sharing_a_target_token():
    # drafter vocab 4: ids 0 and 1 both spell target column 0, id 2 -> column 1, id 3 unmapped
    logits = torch.tensor([[math.log(1.0), math.log(1.0), math.log(2.0), 5.0]])
    lq = lifted_log_probs(logits, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]), 2)
    # renormalised over mapped ids: q = (0.25, 0.25, 0.5) -> columns (0.5, 0.5)
    assert torch.allclose(lq.exp(), torch.tensor([[0.5, 0.5]]), atol=1e-6)


def test_hybrid_loss_and_nll():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    nll = ngram_nll(logits, torch.tensor([0, 0]))
    assert torch.allclose(nll, torch.tensor([math.log(2.0), math.log(4 / 3)]), atol=1e-6)
    out = hybrid_loss(torch.tensor([1.0, 3.0]), nll, lam=0.2)
    assert math.isclose(out["loss"].item(), 2.0 + 0.2 * nll.mean().item(), rel_tol=1e-6)
    assert hybrid_loss(torch.tensor([]), nll)["loss_dm"].item() == 0.0


def test_distillspec_divergences_by_name_on_a_three_token_example():
    """DIVERGENCES[name](log p, log q, beta): p the target, q the drafter (hand-computed)."""
    from omnidraft.learn.losses import DIVERGENCES

    lp, lq = P.log(), Q.log()
    p, q = P[0].tolist(), Q[0].tolist()
    beta = 0.3
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
    expected = {
        "fkl": 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.6),
        "rkl": 0.2 * math.log(0.2 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.6 * math.log(0.6 / 0.2),
        "jsd": beta * sum(a * math.log(a / c) for a, c in zip(p, m)) + (1 - beta) * sum(b * math.log(b / c) for b, c in zip(q, m)),
        "tvd": 0.4,
    }
    assert set(DIVERGENCES) == set(expected)
    for name, want in expected.items():
        got = DIVERGENCES[name](lp, lq, beta=beta).item()
        assert math.isclose(got, want, rel_tol=1e-5), (name, got, want)
    assert not math.isclose(DIVERGENCES["fkl"](lp, lq).item(), DIVERGENCES["rkl"](lp, lq).item(), rel_tol=1e-3)
