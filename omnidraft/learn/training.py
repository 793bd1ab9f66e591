"""The training forward of the online learner: the drafter's logits at each example's drafted
positions, with the examples of one prompt sharing one pass over their common context.

Gradients flow w.r.t. the drafted positions only (the context's keys/values computed without grad),
unless ``context_grad``. With ``tree`` (Llama/Qwen2-style models) every example of a prompt is one
branch of ONE tree-attention pass (:func:`omnidraft.core.kv.forward_branches`): the same logits as
one pass per example, ~batch_size x fewer passes.
"""

from __future__ import annotations

import torch

from omnidraft.core import kv
from omnidraft.learn.buffer import Example


def draft_logits(model, examples: list[Example], *, context_grad: bool = False, tree: bool = True,
                 hidden: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Training-model logits at each example's drafted positions.

    Args:
        model: the training copy of the drafter.
        examples: the mini-batch.
        context_grad: back-propagate through the whole context (one full pass per example).
        tree: one tree-attention pass per prompt (else one cached pass per example).
        hidden: also return the last-layer hidden states there (for a jointly trained head).

    Returns:
        per example: logits (n_drafts, V_d) in float32, and hidden states (n_drafts, H) or None.
    """
    dev = model.device
    out: list[torch.Tensor | None] = [None] * len(examples)
    hid: list[torch.Tensor | None] = [None] * len(examples)
    if context_grad:
        for i, ex in enumerate(examples):
            ids = torch.tensor([ex.ctx + ex.drafts[:-1]], device=dev)
            o = model(input_ids=ids, logits_to_keep=len(ex.drafts), output_hidden_states=hidden)
            out[i] = o.logits[0].float()
            if hidden:
                hid[i] = o.hidden_states[-1][0, -len(ex.drafts):].float()
        return out, hid
    groups: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.seq, []).append(i)
    for idx in groups.values():
        base = max((examples[i].ctx for i in idx), key=len)
        cache = kv.new_cache(model)
        if len(base) > 1:
            with torch.no_grad():
                model(input_ids=torch.tensor([base[:-1]], device=dev), cache=cache, logits_to_keep=1)
        branches = []
        for i in idx:
            ex = examples[i]
            n = 0
            lim = min(len(ex.ctx) - 1, len(base) - 1)
            while n < lim and ex.ctx[n] == base[n]:
                n += 1
            branches.append((n, ex.ctx[n:] + ex.drafts[:-1]))
        if tree:  # every example of the sequence in one pass (tree attention)
            res = kv.forward_branches(model, cache, branches, hidden=hidden)
            lgs, hds = res if hidden else (res, [None] * len(idx))
            for i, lg, hd in zip(idx, lgs, hds):
                n_d = len(examples[i].drafts)
                out[i] = lg[-n_d:].float()
                hid[i] = hd[-n_d:].float() if hd is not None else None
            continue
        for i, (n, b) in zip(idx, branches):
            c = kv.prefix_copy(cache, n, model) if len(base) > 1 else kv.new_cache(model)
            ids = torch.tensor([b], device=dev)
            n_d = len(examples[i].drafts)
            o = model(input_ids=ids, cache=c, logits_to_keep=n_d, output_hidden_states=hidden)
            out[i] = o.logits[0].float()
            if hidden:
                hid[i] = o.hidden_states[-1][0, -n_d:].float()
    return out, hid
