"""The verifier seam of the decode loop: who checks a step's proposals.

:class:`LiveVerifier` runs the target: prefill, then one forward pass over the pending token plus
the proposals per step, greedy or sampling verification (:mod:`omnidraft.core.verify`), and KV
rollback to what was kept. :class:`TraceVerifier` replays a recorded greedy target trajectory
instead (no target forward). Both plug into the same loop through :class:`Verifier`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from omnidraft.core import kv
from omnidraft.core.feedback import Proposal, Verdict
from omnidraft.core.verify import greedy_verify, probs, sample_verify
from omnidraft.errors import OmniDraftError


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


class TraceVerifier:
    """Greedy verification against the target's recorded greedy trajectory (a target trace), with
    no target forward: under greedy verification the proposals a live target accepts are exactly
    the prefix that matches its greedy continuation, and its correction/bonus token is the next
    token of that continuation.

    It gives no target distributions (``Verdict.rows`` is None): observers that learn from them
    (online distillation, the acceptance head) refuse to run on it.

    Args:
        trajectories: prompt ids (as a tuple) -> the target's greedy output ids after that prompt
            (EOS included when reached), as long as the generation asks for or ending at EOS.
    """

    def __init__(self, trajectories: dict[tuple[int, ...], list[int]]):
        self.trajectories = trajectories
        self.out: list[int] = []
        self.pos = 0

    def start(self, prompt_ids: list[int]) -> None:
        out = self.trajectories.get(tuple(prompt_ids))
        if out is None:
            raise OmniDraftError(f"the trace has no trajectory for this prompt ({len(prompt_ids)} tokens, "
                                 f"ending {prompt_ids[-5:]}); trace the prompts first (omnidraft trace)")
        self.out, self.pos = list(out), 0

    def verify(self, pending: int, proposal: Proposal, temperature: float,
               generator: torch.Generator | None) -> Verdict:
        if temperature > 0:
            raise OmniDraftError(f"replay from a target trace verifies greedily only; got temperature "
                                 f"{temperature}: set method.temperature=0 or verify live")
        out, pos = self.out, self.pos
        n = 0
        while n < len(proposal.ids) and pos + n < len(out) and proposal.ids[n] == out[pos + n]:
            n += 1
        if pos + n < len(out):
            nxt = out[pos + n]
        elif out and n and proposal.ids[n - 1] == out[-1]:
            nxt = out[-1]  # the trace ended at EOS, accepted as a proposal: the loop stops there anyway
        else:
            raise OmniDraftError(f"the trace ends after {len(out)} tokens but this generation needs more; "
                                 "trace with at least the decode.max_new_tokens asked for")
        self.pos = pos + n + 1
        return Verdict(n, nxt, None)
