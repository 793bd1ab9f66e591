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


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> int:
    """The index whose cumulative-probability interval [c_{i-1}, c_i) holds ``u * total``: a draw
    from ``dist`` (V,) for a uniform ``u`` in [0, 1) (one element, on ``dist``'s device). Zero-
    probability entries own empty intervals and are never drawn; the point is kept strictly below
    the total, so rounding at the top cannot land on trailing zeros. One int leaves the device."""
    c = dist.double().cumsum(0)
    x = torch.minimum(u.double().reshape(1) * c[-1], torch.nextafter(c[-1:], c.new_zeros(1)))
    return int(torch.searchsorted(c, x, right=True).clamp(max=dist.numel() - 1))


def sample_index(dist: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from ``dist`` (V,) with ``generator``.

    Where the generator lives on ``dist``'s device (a CPU run), ``torch.multinomial``. Where it does
    not (a model on CUDA, the run's seeded generator on the CPU), :func:`inverse_cdf` at one uniform
    from the generator: the full-vocabulary row never crosses to the host, one uniform goes over and
    one int comes back.
    """
    if generator is None or generator.device == dist.device:
        return int(torch.multinomial(dist, 1, generator=generator))
    return inverse_cdf(dist, torch.rand(1, generator=generator, device=generator.device).to(dist.device))


def sample_verify(p: torch.Tensor, q: torch.Tensor, proposal: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Standard speculative sampling (Leviathan et al.; Chen et al.): lossless in distribution.

    Accept proposal i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection,
    sample from norm(max(0, p_i - q_i)); if all are accepted, sample the bonus from p_m.

    Args:
        p: (m+1, V) target probabilities.
        q: (m, V) drafter probabilities in the same (target) vocabulary, on ``p``'s device; q_i(x_i) > 0.
        proposal: (m,) ids drawn from q.
        generator: explicit randomness (it may live on another device than ``p``: the m uniforms
            go over, the acceptance count and the token come back; nothing of size V moves).
    """
    m = proposal.numel()
    if m:
        dev = p.device
        idx = torch.arange(m, device=dev)
        prop = proposal.to(dev)
        ratio = p[idx, prop] / q[idx, prop]
        u = torch.rand(m, generator=generator, device=generator.device if generator is not None else dev)
        ok = (u.to(dev) < ratio).to(torch.int32)
        n = int(ok.cumprod(0).sum())
    else:
        n = 0
    if n < m:
        residual = (p[n] - q[n]).clamp_min(0)
        s = residual.sum()
        dist = residual / s if s > 0 else p[n]
    else:
        dist = p[m]
    return n, sample_index(dist, generator)


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
    q_t = torch.zeros(target_vocab_size, dtype=q_draft.dtype, device=q_draft.device)
    return q_t.index_add_(0, map_tgt.to(q_draft.device), q_draft[map_ids.to(q_draft.device)])
