"""Acceptance and rejection-sampling math: pure tensor functions, no models, no I/O."""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at a temperature, in float32.

    Args:
        logits: (..., V).
        temperature: > 0.
    """
    return torch.softmax(logits.float() / temperature, dim=-1)


def greedy_verify(target_logits: torch.Tensor, proposal: list[int]) -> tuple[int, int]:
    """Accept the longest prefix of the proposal that equals the target's argmax.

    Args:
        target_logits: (m+1, V_t), logits after the pending token and after each proposal.
        proposal: m target ids.

    Returns:
        (n_accepted, next_token): the correction at the first mismatch, or the bonus token.
    """
    top = target_logits.argmax(dim=-1).tolist()  # one device->host transfer per step
    n = 0
    for want, got in zip(proposal, top):
        if want != got:
            break
        n += 1
    return n, top[n]


def sample_verify(p: torch.Tensor, q: torch.Tensor, proposal: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Standard speculative sampling (Leviathan et al.; Chen et al.): lossless in distribution.

    Accept proposal i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection,
    sample from norm(max(0, p_i - q_i)); if all are accepted, sample the bonus from p_m.

    Args:
        p: (m+1, V) target probabilities.
        q: (m, V) drafter probabilities in the same (target) vocabulary; q_i(x_i) > 0.
        proposal: (m,) ids drawn from q.
        generator: explicit randomness.
    """
    m = proposal.numel()
    if m:
        idx = torch.arange(m)
        ratio = p[idx, proposal] / q[idx, proposal]
        u = torch.rand(m, generator=generator)
        ok = (u < ratio).to(torch.int32)
        n = int(ok.cumprod(0).sum())
    else:
        n = 0
    if n < m:
        residual = (p[n] - q[n]).clamp_min(0)
        s = residual.sum()
        dist = residual / s if s > 0 else p[n]
    else:
        dist = p[m]
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return n, nxt


def lift_to_target(q_draft: torch.Tensor, map_ids: torch.Tensor, map_tgt: torch.Tensor,
                   target_vocab_size: int) -> torch.Tensor:
    """Drafter probabilities -> target-vocabulary probabilities through a direct map.

    Args:
        q_draft: (V_d,) drafter probabilities, zero outside the mapped set.
        map_ids: (M,) mapped drafter ids; map_tgt: (M,) their target ids (may repeat: several
            drafter tokens spelling the same bytes add up).
    Returns:
        (V_t,) probabilities of the target token a drafter sample maps to.
    """
    q_t = torch.zeros(target_vocab_size, dtype=q_draft.dtype)
    return q_t.index_add_(0, map_tgt, q_draft[map_ids])
