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


def divergence(name: str):
    """D(p, q) per row from log-probabilities (N, C) -> (N,), for 'fkl' KL(p||q), 'rkl' KL(q||p),
    'jsd' (generalised JSD with ``beta``) and 'tvd'. p is the target (teacher), q the drafter."""
    return DIVERGENCES[name]


DIVERGENCES = {
    "fkl": lambda log_p, log_q, beta=0.5: forward_kl(log_p, log_q),
    "rkl": lambda log_p, log_q, beta=0.5: reverse_kl(log_q, log_p),
    "jsd": lambda log_p, log_q, beta=0.5: jsd(log_p, log_q, beta),
    "tvd": lambda log_p, log_q, beta=0.5: tvd(log_p, log_q),
}
