"""The one speculative decoding loop: every method of this package runs through :func:`generate`
(transformers' own ``generate`` runs only for the baselines that exist to measure it, ``uag``,
``uag_k5`` and ``hf_ar``: :mod:`omnidraft.drafting.hf_assisted`).

One step: the drafter proposes -> the verifier checks (:mod:`omnidraft.core.verifiers`: the live
target, or another verifier behind the same seam) -> the drafter syncs its context to the emitted
tokens -> every observer gets the step's feedback (:mod:`omnidraft.core.feedback`).

``ar`` is the same loop with no drafter (zero proposals per step), so plain and speculative
decoding share the prefill, the target call, the token counting and the timing. This module imports
neither hydra nor wandb.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ContextManager, Protocol

import torch

from omnidraft.core.feedback import Observer, Proposal, StepFeedback, TextSync
from omnidraft.core.verifiers import Verifier, as_verifier

__all__ = ["Drafter", "GenerationResult", "Proposal", "StepRecord", "generate"]


class Drafter(Protocol):
    """A drafting strategy: a model drafter, an n-gram drafter, prompt lookup, ...

    ``start`` receives the prompt, ``propose`` returns up to k target tokens (with its drafting
    record, :class:`omnidraft.core.feedback.Proposal`), ``commit`` receives the tokens the target
    emitted this step (accepted proposals + the correction/bonus token) and keeps the drafter's
    context in sync; it returns the re-tokenisation record (:class:`TextSync`) when the drafter
    has its own vocabulary and the text lines up, else None. Drafters draft; observers learn.
    """

    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal: ...

    def commit(self, new_ids: list[int], n_accepted: int) -> TextSync | None: ...

    def paused(self) -> ContextManager:
        """A warm-up context: what the drafter counts or caches for the stream is put back after."""

    def stats(self) -> dict[str, float]:
        """Cumulative counters (``draft/tokens``, ...); the runner logs per-prompt differences."""


@dataclass
class StepRecord:
    """One step: target proposals, accepted, emitted tokens, drafting and verification seconds, the
    drafter's forwards (tokens each fed; whether they returned hidden states) and where the
    proposals came from (:attr:`omnidraft.core.feedback.Proposal.source`)."""

    proposed: int
    accepted: int
    emitted: int
    draft_s: float
    target_s: float
    draft_feeds: tuple[int, ...] = ()
    draft_hidden: bool = False
    source: str = "model"


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


def _clock(model):
    """``time.perf_counter``, after the model's queued CUDA work finishes when it runs on a GPU (each
    phase already ends in a host copy of ids, but the prefill does not)."""
    device = getattr(model, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced


def generate(target, prompt_ids: list[int], *, drafter: Drafter | None = None, k: int = 5,
             max_new_tokens: int = 128, eos_ids: set[int] | frozenset = frozenset(),
             temperature: float = 0.0, generator: torch.Generator | None = None,
             observers: Sequence[Observer] = ()) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids``.

    Each step feeds the pending token plus the drafter's m <= k proposals to the verifier, which
    accepts a prefix (greedy argmax match at temperature 0, else standard speculative sampling);
    the step emits accepted + one more token.

    Args:
        target: a :class:`Verifier`, or a causal LM (verified live: :class:`LiveVerifier`).
        prompt_ids: the prompt in target ids (chat template already applied), length >= 1.
        drafter: a Drafter, or None for plain autoregressive decoding.
        k: draft length per step.
        temperature: 0 for greedy, else sampling temperature for both models.
        generator: explicit randomness for sampling.
        observers: learn from every step's :class:`StepFeedback`, in this order; an observer's
            optional ``finish()`` is called once the generation ends.
    """
    assert prompt_ids, "empty prompt"
    verifier: Verifier = as_verifier(target)
    clock = _clock(getattr(verifier, "target", None))
    t_start = clock()
    verifier.start(prompt_ids)
    pending = prompt_ids[-1]
    if drafter is not None:
        drafter.start(prompt_ids)
        for o in observers:
            o.start(prompt_ids)
    res = GenerationResult(tokens=[])
    res.prefill_s = clock() - t_start
    out = res.tokens
    while len(out) < max_new_tokens:
        t0 = clock()
        budget = min(k, max_new_tokens - len(out) - 1)
        prop = drafter.propose(budget, temperature, generator) if drafter is not None and budget > 0 \
            else Proposal([])
        t1 = clock()
        verdict = verifier.verify(pending, prop, temperature, generator)
        n, nxt = verdict.n_accepted, verdict.next_token
        t2 = clock()
        new = prop.ids[:n] + [nxt]
        stop_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        new = new[: max_new_tokens - len(out)]
        out.extend(new)
        pending = nxt
        if drafter is not None:
            sync = drafter.commit(new, n)
            if observers:
                fb = StepFeedback(prop, verdict.rows, n, new, temperature, sync)
                for o in observers:
                    o.observe(fb)
        t3 = clock()
        res.steps.append(StepRecord(len(prop.ids), n, len(new), (t1 - t0) + (t3 - t2), t2 - t1,
                                    prop.feeds, prop.fed_hidden, prop.source))
        if stop_at is not None:
            res.stop = "eos"
            break
    if drafter is not None:
        for o in observers:
            finish = getattr(o, "finish", None)
            if finish is not None:
                finish()
    res.wall_s = clock() - t_start
    return res
