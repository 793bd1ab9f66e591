"""The one speculative decoding loop. Every method and baseline runs through :func:`generate`.

``ar`` is the same loop with no drafter (zero proposals per step), so plain and speculative
decoding share the prefill, the target call, the token counting and the timing. This module imports
neither hydra nor wandb.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnidraft.core import kv
from omnidraft.core.verify import greedy_verify, probs, sample_verify


@dataclass
class Proposal:
    """What a drafter proposes for one step.

    Attributes:
        ids: m proposed target-token ids.
        q: (m, V_t) drafter probabilities in target space (sampling only), else None.
    """

    ids: list[int]
    q: torch.Tensor | None = None


class Drafter(Protocol):
    """A drafting strategy: a model drafter, an n-gram drafter, ...

    ``start`` receives the prompt, ``propose`` returns up to k target tokens, ``commit`` receives
    the tokens the target emitted this step (accepted proposals + the correction/bonus token) and
    the verification logits (m+1, V_t) already computed, which online learners use as targets.
    """

    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal: ...

    def commit(self, new_ids: list[int], n_accepted: int, target_logits: torch.Tensor) -> None: ...


@dataclass
class StepRecord:
    proposed: int
    accepted: int
    emitted: int
    draft_s: float
    target_s: float


@dataclass
class GenerationResult:
    """Output and per-step statistics of one generation.

    ``wall_s`` covers everything from the first prefill to the last token: target and drafter
    prefill, drafting, verification and drafter sync.
    """

    tokens: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    wall_s: float = 0.0
    prefill_s: float = 0.0
    stop: str = "length"

    @property
    def n_new(self) -> int:
        return len(self.tokens)

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def target_s(self) -> float:
        return sum(s.target_s for s in self.steps)


def generate(target, prompt_ids: list[int], *, drafter: Drafter | None = None, k: int = 5,
             max_new_tokens: int = 128, eos_ids: set[int] | frozenset = frozenset(),
             temperature: float = 0.0, generator: torch.Generator | None = None) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` with the target model.

    Each step feeds the pending token plus the drafter's m <= k proposals to the target in one
    forward pass, verifies them (greedy argmax match at temperature 0, else standard speculative
    sampling), emits accepted + one more token, and crops the target KV cache to what was kept.

    Args:
        target: a causal LM (transformers, public forward with ``past_key_values``).
        prompt_ids: the prompt in target ids (chat template already applied), length >= 1.
        drafter: a Drafter, or None for plain autoregressive decoding.
        k: draft length per step.
        temperature: 0 for greedy, else sampling temperature for both models.
        generator: explicit randomness for sampling.
    """
    assert prompt_ids, "empty prompt"
    greedy = temperature <= 0
    t_start = time.perf_counter()
    cache = kv.new_cache(target)
    if len(prompt_ids) > 1:
        kv.forward(target, prompt_ids[:-1], cache, keep=1)
    pending = prompt_ids[-1]
    if drafter is not None:
        drafter.start(prompt_ids)
    res = GenerationResult(tokens=[])
    res.prefill_s = time.perf_counter() - t_start
    out = res.tokens
    while len(out) < max_new_tokens:
        t0 = time.perf_counter()
        budget = min(k, max_new_tokens - len(out) - 1)
        prop = drafter.propose(budget, temperature, generator) if drafter is not None and budget > 0 \
            else Proposal([])
        t1 = time.perf_counter()
        m = len(prop.ids)
        logits = kv.forward(target, [pending] + prop.ids, cache)
        if greedy:
            n, nxt = greedy_verify(logits, prop.ids)
        else:
            n, nxt = sample_verify(probs(logits, temperature).cpu(), prop.q,
                                   torch.tensor(prop.ids, dtype=torch.long), generator)
        kv.crop_to(cache, kv.cache_len(cache) - (m - n))
        t2 = time.perf_counter()
        new = prop.ids[:n] + [nxt]
        stop_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        new = new[: max_new_tokens - len(out)]
        out.extend(new)
        pending = nxt
        if drafter is not None:
            drafter.commit(new, n, logits)
        t3 = time.perf_counter()
        res.steps.append(StepRecord(m, n, len(new), (t1 - t0) + (t3 - t2), t2 - t1))
        if stop_at is not None:
            res.stop = "eos"
            break
    res.wall_s = time.perf_counter() - t_start
    return res
