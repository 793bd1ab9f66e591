"""Certify a divergence between speculative and plain greedy output in a low-precision dtype.

Greedy speculative decoding emits the target's argmax at every position, but the target's logits
there come from a different computation (one forward over the drafted tokens, against one token
at a time for ``ar``). In fp32 the two agree to far below any gap between the top two logits; in
bf16 they can differ by a few units in the last place, so where the top two logits are that close
the argmax can flip and the outputs part. Such a divergence is a numerical near-tie, not a bug.

:func:`certify` recomputes the target's logits at the first differing position both ways (the
whole prefix in one forward, as verification feeds drafted tokens; the prefix minus its last token,
then that token alone, as ``ar`` steps) and calls it a near-tie only when the top-2 gap in either
computation is below the dtype's resolution at the top logit (``finfo(dtype).eps * |top1|``: one
unit in the last place). Anything else is unexplained.
"""

from __future__ import annotations

import torch

from omnidraft.core import kv


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a shorter one ends there), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _gap(logits: torch.Tensor) -> tuple[float, float]:
    top = torch.topk(logits.float(), 2).values.tolist()
    return top[0] - top[1], top[0]


@torch.no_grad()
def certify(model, prompt: list[int], sd_tokens: list[int], ar_tokens: list[int]) -> dict[str, float | bool] | None:
    """The divergence of ``sd_tokens`` from ``ar_tokens`` (both continuing ``prompt``), certified.

    Args:
        model: the target (its own dtype and device).
        prompt: the prompt's target ids.
        sd_tokens, ar_tokens: the two outputs.

    Returns:
        None where they are equal; else ``lossless/diverge_at`` (index into the output),
        ``lossless/gap_batched`` and ``lossless/gap_stepwise`` (top-2 logit gaps at that position
        in the two computations), ``lossless/resolution`` (one ulp of the top logit in the
        model's dtype) and ``lossless/near_tie``.
    """
    p = first_divergence(sd_tokens, ar_tokens)
    if p is None:
        return None
    prefix = prompt + ar_tokens[:p]
    batched = kv.forward(model, prefix, kv.new_cache(model), keep=1)[-1]
    if len(prefix) > 1:
        cache = kv.new_cache(model)
        kv.forward(model, prefix[:-1], cache, keep=1)
        stepwise = kv.forward(model, prefix[-1:], cache)[-1]
    else:
        stepwise = batched
    dtype = next(model.parameters()).dtype
    gaps = [_gap(batched), _gap(stepwise)]
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    resolution = eps * max(abs(top) for _, top in gaps)
    return {"lossless/diverge_at": p, "lossless/gap_batched": gaps[0][0], "lossless/gap_stepwise": gaps[1][0],
            "lossless/resolution": resolution, "lossless/near_tie": min(g for g, _ in gaps) <= resolution}
