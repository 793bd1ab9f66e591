"""Online adaptation of the drafter from the live stream (OmniDraft's hybrid distillation).

Data is on-policy: each speculative step records the drafter's context, its drafted tokens, and
the target's distributions at the proposed positions, taken from the verification pass already
computed (no extra target forward). Every ``interval`` prompts the runner calls :meth:`update`,
which runs AdamW on the buffer and clears it (no replay). The target is never touched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from omnidraft import kv
from omnidraft.distill import hybrid_loss, lifted_log_probs, ngram_nll, reverse_kl
from omnidraft.ngram_cache import Merged
from omnidraft.vocab import VocabBridge

LOSSES = ("kl_nll", "nll_only")


@dataclass
class Example:
    """One speculative step, as training data.

    Attributes:
        ctx: drafter context before drafting.
        drafts: drafter tokens behind the merged proposals.
        dm_pos: draft positions whose proposal is a directly mapped token.
        dm_logp: (len(dm_pos), C) target log-probabilities over the reachable target tokens.
        ng_pos: draft positions of sub-tokens of n-grams the target accepted.
    """

    ctx: list[int]
    drafts: list[int]
    dm_pos: list[int]
    dm_logp: torch.Tensor
    ng_pos: list[int]


def with_lora(model, rank: int, alpha: int | None = None, target_modules: list[str] | None = None):
    """Wrap a drafter with LoRA adapters (peft); the base weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=int(rank), lora_alpha=int(alpha or 2 * rank), lora_dropout=0.0,
                     target_modules=list(target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"]))
    wrapped = get_peft_model(model, cfg)
    for p in wrapped.parameters():
        p.requires_grad_(False)
    return wrapped.eval()


class OnlineLearner:
    """Buffer + optimiser for the drafter.

    Args:
        model: the drafter LM (its weights are trained in place; inference mode restored after).
        bridge: the direct map drafter -> target.
        lam: weight of the n-gram NLL term (paper: 0.2); 0 gives ``L_DM`` only.
        loss: 'kl_nll' (reverse KL on DM positions + lam * NLL on n-grams) or 'nll_only'.
        context_grad: back-propagate through the whole context (exact, ~tokens x slower) or only
            through the <= k drafted positions, the context's keys/values computed without grad
            (default; project choice, the paper is silent).

    Trained parameters keep fp32 master copies (the optimiser steps on them, then they are cast
    back into the model), so small updates survive bf16 weights.
    """

    def __init__(self, model, bridge: VocabBridge, *, lam: float = 0.2, loss: str = "kl_nll",
                 lr: float = 1e-4, weight_decay: float = 0.01, batch_size: int = 8,
                 steps_per_update: int = 1, seed: int = 0, context_grad: bool = False):
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.model, self.lam, self.loss_name = model, float(lam), loss
        self.batch_size, self.steps_per_update = int(batch_size), int(steps_per_update)
        self.map_ids = torch.nonzero(bridge.draft_mask).squeeze(1)
        tgt = bridge.d2t[self.map_ids]
        self.cols = torch.unique(tgt)  # reachable target tokens, sorted
        self.map_cols = torch.searchsorted(self.cols, tgt)
        self.buffer: list[Example] = []
        self.rng = random.Random(seed)
        # With LoRA (peft) only the adapter weights train; otherwise the whole drafter.
        named = list(model.named_parameters())
        lora = [p for n, p in named if "lora_" in n]
        self.params = lora if lora else [p for _, p in named]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
        self.context_grad = bool(context_grad)
        self.n_updates = 0

    def record(self, ctx: list[int], drafts: list[int], merged: list[Merged],
               target_logits: torch.Tensor, n_accepted: int) -> None:
        """Store one step. ``target_logits`` row i is the target's distribution for proposal i."""
        if not merged:
            return
        dm_rows, dm_pos, ng_pos = [], [], []
        for i, m in enumerate(merged):
            if m.is_ngram:
                if i < n_accepted:
                    ng_pos.extend(range(m.start, m.end))
            else:
                dm_rows.append(i)
                dm_pos.append(m.start)
        logp = torch.log_softmax(target_logits[dm_rows].float(), -1)[:, self.cols.to(target_logits.device)]
        self.buffer.append(Example(ctx, drafts, dm_pos, logp.to(torch.float16).cpu(), ng_pos))

    def losses(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """Hybrid loss over examples (differentiable w.r.t. the drafter)."""
        dm_terms, ng_terms = [], []
        dev = self.model.device
        for ex in examples:
            if self.context_grad:
                ids = torch.tensor([ex.ctx + ex.drafts[:-1]], device=dev)
                logits = self.model(input_ids=ids, logits_to_keep=len(ex.drafts)).logits[0].float()
            else:
                cache = kv.new_cache(self.model)
                if len(ex.ctx) > 1:
                    with torch.no_grad():
                        self.model(input_ids=torch.tensor([ex.ctx[:-1]], device=dev), cache=cache,
                                   logits_to_keep=1)
                ids = torch.tensor([ex.ctx[-1:] + ex.drafts[:-1]], device=dev)
                logits = self.model(input_ids=ids, cache=cache).logits[0].float()
            if ex.dm_pos and self.loss_name == "kl_nll":
                lq = lifted_log_probs(logits[ex.dm_pos], self.map_ids.to(dev), self.map_cols.to(dev), len(self.cols))
                dm_terms.append(reverse_kl(lq, ex.dm_logp.to(dev).float()))
            if ex.ng_pos:
                ng_terms.append(ngram_nll(logits[ex.ng_pos], torch.tensor([ex.drafts[j] for j in ex.ng_pos], device=dev)))
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, device=dev)  # noqa: E731
        lam = 1.0 if self.loss_name == "nll_only" else self.lam
        return hybrid_loss(cat(dm_terms), cat(ng_terms), lam)

    @torch.no_grad()
    def _step(self) -> None:
        """fp32 master step: model grads -> master, AdamW, master -> model weights."""
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.dtype))

    def update(self, progress: bool = True) -> dict[str, float]:
        """AdamW steps over the buffer in mini-batches, then clear it. Returns mean losses."""
        from tqdm.auto import tqdm

        if not self.buffer:
            return {}
        self.model.train()
        for p in self.params:
            p.requires_grad_(True)
        stats = {"adapt/loss": 0.0, "adapt/loss_dm": 0.0, "adapt/loss_ngram": 0.0}
        n, n_examples = 0, len(self.buffer)
        n_batches = self.steps_per_update * -(-n_examples // self.batch_size)
        bar = tqdm(total=n_batches, desc="adapt", unit="batch", leave=False, disable=not progress)
        try:
            for _ in range(self.steps_per_update):
                order = list(range(len(self.buffer)))
                self.rng.shuffle(order)
                for b in range(0, len(order), self.batch_size):
                    bar.update(1)
                    out = self.losses([self.buffer[i] for i in order[b: b + self.batch_size]])
                    if out["loss"].requires_grad:
                        out["loss"].backward()
                        self._step()
                    for k, key in (("loss", "adapt/loss"), ("loss_dm", "adapt/loss_dm"), ("loss_ngram", "adapt/loss_ngram")):
                        stats[key] += float(out[k].detach())
                    n += 1
        finally:
            bar.close()
            self.opt.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
                p.requires_grad_(False)
            self.model.eval()
            self.buffer.clear()
        self.n_updates += 1
        return {k: v / max(1, n) for k, v in stats.items()} | {"adapt/n_examples": n_examples,
                                                                "adapt/n_batches": n}
