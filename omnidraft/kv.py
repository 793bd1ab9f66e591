"""KV-cache helpers over transformers' public Cache API."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_len(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def crop_to(cache: DynamicCache, keep: int) -> None:
    """Keep the first ``keep`` positions. (transformers 5.x ``crop`` takes minus the number to drop.)"""
    drop = cache_len(cache) - keep
    if drop > 0:
        cache.crop(-drop)
    elif drop < 0:
        raise ValueError(f"cannot crop a cache of {cache_len(cache)} positions to {keep}")


@torch.no_grad()
def forward(model, ids: list[int], cache: DynamicCache, keep: int = 0) -> torch.Tensor:
    """Feed ``ids`` after the cached prefix.

    Args:
        keep: compute logits for the last ``keep`` positions only (0 = all).
    Returns:
        logits (len(ids) or keep, V).
    """
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    return model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=keep).logits[0]


@torch.no_grad()
def forward_hidden(model, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``ids``; (logits of the last position (V,), last-layer hidden state there (H,))."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1, output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


def prefix_copy(cache: DynamicCache, n: int, model) -> DynamicCache:
    """A new cache holding the first ``n`` positions of ``cache`` (``cache`` is left untouched:
    later updates of the copy concatenate into new tensors)."""
    data = [(layer.keys[..., :n, :], layer.values[..., :n, :]) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=data, config=model.config)
