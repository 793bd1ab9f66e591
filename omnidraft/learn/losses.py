"""Distillation losses for online drafter adaptation (pure tensor functions).

OmniDraft's hybrid loss: L = L_DM + lambda * L_Ngram, where L_DM is the reverse KL KL(q' || p) at
directly mapped positions, computed in target-vocabulary space (the drafter's distribution lifted
through the direct map, restricted to the target tokens the drafter can reach), and L_Ngram is
the drafter's NLL on the sub-tokens of n-grams the target accepted. OSD's forward KL and
DistillSpec's divergences live here too, so every method trains through the same functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lifted_log_probs(draft_logits: torch.Tensor, map_ids: torch.Tensor, map_cols: torch.Tensor,
                     n_cols: int) -> torch.Tensor:
    """log q'(t) over the reachable target tokens.

    Args:
        draft_logits: (N, V_d) drafter logits.
        map_ids: (M,) directly mapped drafter ids.
        map_cols: (M,) column (0..n_cols-1) of each one's target token among the reachable ones;
            several drafter ids may share a column (their probabilities add up).
    Returns:
        (N, n_cols) log-probabilities of the drafter restricted to mapped tokens, renormalised.
    """
    logq = torch.log_softmax(draft_logits[:, map_ids].float(), dim=-1)  # (N, M)
    q = torch.zeros(draft_logits.shape[0], n_cols, dtype=logq.dtype, device=logq.device)
    q = q.index_add(1, map_cols, logq.exp())
    return torch.log(q.clamp_min(1e-30))


def reverse_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(q || p) per row: sum_t q(t) (log q(t) - log p(t)). Shapes (N, C) -> (N,)."""
    q = log_q.exp()
    return (q * (log_q - log_p)).sum(-1)


def forward_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row (OSD's soft cross-entropy up to p's entropy). (N, C) -> (N,)."""
    p = log_p.exp()
    return (p * (log_p - log_q)).sum(-1)


def jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon: beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q."""
    m = (beta * log_p.exp() + (1 - beta) * log_q.exp()).clamp_min(1e-30).log()
    return beta * forward_kl(log_p, m) + (1 - beta) * forward_kl(log_q, m)


def tvd(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Total variation distance per row: 0.5 sum |p - q|."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def ngram_nll(draft_logits: torch.Tensor, sub_tokens: torch.Tensor) -> torch.Tensor:
    """NLL of the drafter on n-gram sub-tokens. (N, V_d), (N,) -> (N,)."""
    return F.cross_entropy(draft_logits.float(), sub_tokens, reduction="none")


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def hybrid_loss(dm_terms: torch.Tensor, ngram_terms: torch.Tensor, lam: float = 0.2) -> dict[str, torch.Tensor]:
    """L = mean(L_DM) + lambda * mean(L_Ngram); an empty term counts as zero."""
    l_dm, l_ng = _mean(dm_terms), _mean(ngram_terms)
    return {"loss": l_dm + lam * l_ng, "loss_dm": l_dm, "loss_ngram": l_ng}


# D(p, q) per row from log-probabilities (N, C) -> (N,), for 'fkl' KL(p||q), 'rkl' KL(q||p), 'jsd'
# (generalised JSD with ``beta``) and 'tvd'. p is the target (teacher), q the drafter.
DIVERGENCES = {
    "fkl": lambda log_p, log_q, beta=0.5: forward_kl(log_p, log_q),
    "rkl": lambda log_p, log_q, beta=0.5: reverse_kl(log_q, log_p),
    "jsd": lambda log_p, log_q, beta=0.5: jsd(log_p, log_q, beta),
    "tvd": lambda log_p, log_q, beta=0.5: tvd(log_p, log_q),
}


def bernoulli_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) from log-probabilities (the ``kl_kl`` loss's n-gram term)."""
    log_q, log_p = log_q.clamp(max=-1e-6), log_p.clamp(max=-1e-6)
    q = log_q.exp()
    return q * (log_q - log_p) + (1 - q) * (torch.log1p(-q) - torch.log1p(-log_p.exp()))


# -- the online losses by name: a directly-mapped term and an n-gram term per example ---------------
# A DM term maps (lq: (N, C) the drafter's lifted log-probs at the example's DM positions, the
# example, jsd_beta) to per-position terms (or None); an n-gram term maps (nll: per-sub-token NLL of
# the drafter on accepted n-grams, the example) to terms.


def _dm_reverse_kl(lq, ex, beta):
    return reverse_kl(lq, ex.dm_logp.to(lq.device).float())


def _dm_argmax_nll(lq, ex, beta):
    rows = [r for r, c in enumerate(ex.dm_top) if c >= 0]
    return -lq[rows, torch.tensor([ex.dm_top[r] for r in rows], device=lq.device)] if rows else None


def _dm_divergence(name: str):
    def term(lq, ex, beta):  # the teacher renormalised over the reachable target tokens
        lp = torch.log_softmax(ex.dm_logp.to(lq.device).float(), -1)
        return DIVERGENCES[name](lp, lq, beta=beta)
    return term


def _ng_nll(nll, ex):
    return nll


def _ng_bernoulli_kl(nll, ex):
    sizes = [e - s for s, e, _ in ex.ngrams]
    log_q = -torch.stack([x.sum() for x in torch.split(nll, sizes)])
    log_p = torch.tensor([lp for _, _, lp in ex.ngrams], device=nll.device)
    return bernoulli_kl(log_q, log_p)


class OnlineLoss:
    """L = mean(DM terms) + lam * mean(n-gram terms) over a mini-batch.

    Args:
        dm: the directly-mapped term, or None (no DM term).
        ngram: the n-gram term, or None (no n-gram term).
        lam: a fixed lambda for this loss (None: the configured ``method.adapt.lam``).
    """

    def __init__(self, dm, ngram, lam: float | None = None):
        self.dm, self.ngram, self.lam = dm, ngram, lam


LOSSES: dict[str, OnlineLoss] = {
    # OmniDraft's hybrid loss: reverse KL on DM positions + lambda * NLL on accepted n-gram sub-tokens
    "kl_nll": OnlineLoss(_dm_reverse_kl, _ng_nll),
    "nll_only": OnlineLoss(None, _ng_nll, lam=1.0),  # n-gram NLL only
    "nll_nll": OnlineLoss(_dm_argmax_nll, _ng_nll),  # NLL of the target's argmax at DM positions
    "kl_kl": OnlineLoss(_dm_reverse_kl, _ng_bernoulli_kl),  # approximate KL on n-grams too
    # one divergence on DM positions, no n-gram term (OSD: fkl; DistillSpec: any)
    **{name: OnlineLoss(_dm_divergence(name), None) for name in DIVERGENCES},
}
