"""The verifier seam of the decode loop: who checks a step's proposals.

:class:`LiveVerifier` runs the target: prefill, then one forward pass over the pending token plus
the proposals per step, greedy or sampling verification (:mod:`omnidraft.core.verify`), and KV
rollback to what was kept. Another verifier (e.g. replay from a recorded target trace) plugs into
the same loop by implementing :class:`Verifier`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from omnidraft.core import kv
from omnidraft.core.feedback import Proposal, Verdict
from omnidraft.core.verify import greedy_verify, probs, sample_verify


class Verifier(Protocol):
    """Checks proposals against the target for one generation at a time."""

    def start(self, prompt_ids: list[int]) -> None:
        """Begin a generation: everything before the prompt's last token is context (prefill)."""

    def verify(self, pending: int, proposal: Proposal, temperature: float,
               generator: torch.Generator | None) -> Verdict:
        """Verify ``proposal`` after ``pending`` (the last emitted, not yet fed token)."""


class LiveVerifier:
    """The target model itself, with its KV cache.

    Args:
        target: a causal LM (transformers, public forward with ``past_key_values``).
    """

    def __init__(self, target):
        self.target = target
        self.cache = None

    def start(self, prompt_ids: list[int]) -> None:
        self.cache = kv.new_cache(self.target)
        if len(prompt_ids) > 1:
            kv.forward(self.target, prompt_ids[:-1], self.cache, keep=1)

    def verify(self, pending: int, proposal: Proposal, temperature: float,
               generator: torch.Generator | None) -> Verdict:
        m = len(proposal.ids)
        logits = kv.forward(self.target, [pending] + proposal.ids, self.cache)
        if temperature <= 0:
            n, nxt = greedy_verify(logits, proposal.ids)
        else:
            n, nxt = sample_verify(probs(logits, temperature).cpu(), proposal.q,
                                   torch.tensor(proposal.ids, dtype=torch.long), generator)
        kv.crop_to(self.cache, kv.cache_len(self.cache) - (m - n))
        return Verdict(n, nxt, logits)


def as_verifier(target) -> Verifier:
    """A verifier as is; a model becomes a :class:`LiveVerifier`."""
    return target if hasattr(target, "verify") and hasattr(target, "start") else LiveVerifier(target)
