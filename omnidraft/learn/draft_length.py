"""Draft-length policies behind one interface.

- :class:`FixedK`: always k drafter tokens (the default everywhere).
- :class:`HeuristicK`: transformers' assisted-generation schedule: the draft length grows by 2
  after a step whose proposals were all accepted and shrinks by 1 otherwise (>= 1).
- :class:`HeadPolicy`: SpecDec++: the acceptance head (:mod:`omnidraft.learn.acceptance_head`)
  predicts P(accept_i | all before accepted) on the drafter's hidden state; drafting stops after
  the token at which 1 - prod_j P_j exceeds gamma (that token is kept), within k_min..k_max.

The head runs per DRAFTER token, so cross-vocabulary the stop rule acts on drafter tokens. Stopping
inside an n-gram leaves a partial spelling, which the merge pass treats like any other draft
(truncates there unless the first sub-token is directly mapped).

A policy is consulted by the drafter while it drafts (``max_len``, ``begin``, ``keep_going``) and
observes each step's outcome (``observe``) like every other observer of the decode loop.
"""

from __future__ import annotations

import torch

from omnidraft.core.feedback import StepFeedback
from omnidraft.drafting.model_drafters import FixedLength
from omnidraft.learn.acceptance_head import AcceptanceHead


class FixedK(FixedLength):
    """Always the step's budget (k)."""

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def observe(self, fb: StepFeedback) -> None:
        """Observer of the decode loop: the step's outcome."""
        self.update(len(fb.proposal.ids), fb.n_accepted)

    def update(self, proposed: int, accepted: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class HeuristicK(FixedK):
    """transformers' schedule for assisted generation: +2 after full acceptance, -1 otherwise."""

    def __init__(self, k_start: int = 5, k_min: int = 1, k_max: int = 16):
        self.k, self.k_min, self.k_max = int(k_start), int(k_min), int(k_max)

    def max_len(self, budget: int) -> int:
        return min(budget, self.k)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == proposed else max(self.k_min, self.k - 1)

    def state_dict(self) -> dict:
        return {"k": self.k}

    def load_state_dict(self, d: dict) -> None:
        self.k = int(d.get("k", self.k))


class HeadPolicy(FixedK):
    """Stop when 1 - prod P(accept) > gamma (the token that crosses is kept), k_min..k_max."""

    needs_hidden = True

    def __init__(self, head: AcceptanceHead, gamma: float = 0.7, k_min: int = 1, k_max: int = 16):
        self.head, self.gamma, self.k_min, self.k_max = head, float(gamma), int(k_min), int(k_max)
        self.preds: list[float] = []  # P(accept) of each token drafted this step

    def max_len(self, budget: int) -> int:
        return min(budget, self.k_max)

    def begin(self) -> None:
        self.preds = []

    @torch.no_grad()
    def keep_going(self, hidden: torch.Tensor | None) -> bool:
        p = float(torch.sigmoid(self.head(hidden.reshape(1, -1)))[0])
        self.preds.append(p)
        prod = 1.0
        for x in self.preds:
            prod *= x
        return not (len(self.preds) >= self.k_min and 1.0 - prod > self.gamma)
