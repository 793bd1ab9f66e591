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


@torch.no_grad()
def forward_states(model, ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """Feed ``ids``; the last layer's states (len(ids), H) from which the model's head makes its
    logits (:func:`logits_of`), without the (len(ids), V) logits themselves. For the architectures
    whose logits are their output head's linear map of these states (:data:`_TREE_MASK_TYPES`: no
    logit soft-capping)."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    return model.get_decoder()(input_ids=x, cache=cache, use_cache=True).last_hidden_state[0]


@torch.no_grad()
def logits_of(model, states: torch.Tensor) -> torch.Tensor:
    """The model's logits for last-layer states from :func:`forward_states` (its output head)."""
    return model.get_output_embeddings()(states)


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from(tensors: list[tuple[torch.Tensor, torch.Tensor]], model) -> DynamicCache:
    """A cache holding these layers' (keys, values) (:func:`cache_tensors`)."""
    return DynamicCache(ddp_cache_data=list(tensors), config=model.config)


def prefix_copy(cache: DynamicCache, n: int, model) -> DynamicCache:
    """A new cache holding the first ``n`` positions of ``cache`` (``cache`` is left untouched:
    later updates of the copy concatenate into new tensors)."""
    data = [(layer.keys[..., :n, :], layer.values[..., :n, :]) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=data, config=model.config)


# Architectures whose every layer attends through the one mask passed in (no sliding-window or
# bidirectional layers that would need a mask of their own): safe for a custom 4D tree mask.
_TREE_MASK_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def tree_mask_ok(model) -> bool:
    cfg = model.config
    return cfg.model_type in _TREE_MASK_TYPES and not getattr(cfg, "use_sliding_window", False)


def forward_branches(model, cache: DynamicCache, branches: list[tuple[int, list[int]]], hidden: bool = False
                     ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Several continuations of one cached prefix in ONE forward pass (tree attention).

    Branch i = (n_i, ids_i): ids_i continues the first n_i cached positions, at positions
    n_i, n_i + 1, ... It attends to cache positions < n_i and to its own earlier tokens only,
    so its logits equal those of feeding ids_i after ``prefix_copy(cache, n_i)``. Gradients flow
    (call under no_grad for inference); ``cache`` is extended by the pass: do not reuse it.

    Returns:
        logits (len(ids_i), V) per branch; with ``hidden``, also the last-layer hidden states
        (len(ids_i), H) per branch (the same ones :func:`forward_hidden` returns).
    """
    past = cache_len(cache)
    lens = [len(ids) for _, ids in branches]
    total = sum(lens)
    dev = model.device
    allowed = torch.zeros(total, past + total, dtype=torch.bool, device=dev)
    pos, ids, at = [], [], 0
    for (n, b), m in zip(branches, lens):
        if not 0 <= n <= past:
            raise ValueError(f"branch prefix {n} outside the cached {past} positions")
        allowed[at:at + m, :n] = True
        allowed[at:at + m, past + at:past + at + m] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        pos.extend(range(n, n + m))
        ids.extend(b)
        at += m
    dtype = model.get_input_embeddings().weight.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)
    out = model(input_ids=torch.tensor([ids], device=dev), cache=cache, use_cache=True,
                attention_mask=mask[None, None], position_ids=torch.tensor([pos], device=dev),
                output_hidden_states=hidden)
    logits = list(torch.split(out.logits[0], lens))
    return (logits, list(torch.split(out.hidden_states[-1][0], lens))) if hidden else logits
