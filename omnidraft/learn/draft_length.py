"""Draft-length policies behind one interface.

- :class:`FixedK`: always k drafter tokens (the default everywhere).
- :class:`HeuristicK`: transformers' assisted-generation schedule: the draft length grows by 2
  after a step whose proposals were all accepted and shrinks by 1 otherwise (>= 1).
- :class:`HeadPolicy`: SpecDec++: the acceptance head (:mod:`omnidraft.learn.acceptance_head`)
  predicts P(accept_i | all before accepted) on the drafter's hidden state; drafting stops after
  the token at which 1 - prod_j P_j exceeds gamma (that token is kept), within k_min..k_max.
- :class:`ConfidenceK`: stop after a drafted token the drafter itself is unsure of (its probability
  below a threshold), as transformers' assisted generation does.
- :class:`CostK`: the draft length (0 included: a plain target step) with the most expected tokens
  per second under this machine's calibrated forward latencies, from acceptance counted online per
  draft source (drafter LM, prompt lookup).

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

    learns = False  # whether what it observes changes later drafting (Session.learns): a moving schedule does

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def observe(self, fb: StepFeedback) -> None:
        """Observer of the decode loop: the step's outcome (steps the drafter LM did not draft, e.g.
        prompt-lookup proposals, say nothing about how far it drafts well)."""
        if fb.proposal.source != "model":
            return
        self.update(len(fb.proposal.ids), fb.n_accepted)

    def update(self, proposed: int, accepted: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class HeuristicK(FixedK):
    """transformers' schedule for assisted generation: +2 after full acceptance, -1 otherwise."""

    learns = True  # k carries over from prompt to prompt

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
    def keep_going(self, hidden: torch.Tensor | None, prob: float | None = None) -> bool:
        p = float(torch.sigmoid(self.head(hidden.reshape(1, -1)))[0])
        self.preds.append(p)
        prod = 1.0
        for x in self.preds:
            prod *= x
        return not (len(self.preds) >= self.k_min and 1.0 - prod > self.gamma)


class ConfidenceK(FixedK):
    """Stop after a drafted token whose drafter probability is below ``min_prob`` (that token is
    kept), within k_min..the step's budget: transformers' ``assistant_confidence_threshold`` rule.
    Free: the drafter's own distribution, no head, no calibration. Cross-vocabulary it acts on
    drafter tokens, like :class:`HeadPolicy`."""

    needs_prob = True

    def __init__(self, min_prob: float = 0.4, k_min: int = 1):
        if not 0.0 <= float(min_prob) <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.min_prob, self.k_min = float(min_prob), int(k_min)
        self.n = 0

    def begin(self) -> None:
        self.n = 0

    def keep_going(self, hidden: torch.Tensor | None, prob: float | None = None) -> bool:
        self.n += 1
        return self.n < self.k_min or prob is None or prob >= self.min_prob


class CostK(FixedK):
    """The draft length that maximises expected tokens per second on this machine.

    Each step's expected emitted tokens for j proposals is ``1 + sum_{i<=j} prod_{l<=i} h_l``, with
    h_l the probability that proposal l is accepted once those before it were, counted online per
    draft source (the drafter LM; prompt lookup, by the length of the n-gram that matched, capped at
    4); its cost is j drafter forwards (none for lookup) plus a target forward of j + 1 tokens, both
    from this machine's latency calibration (``omnidraft calibrate``). The step drafts the j with the
    highest ratio, 0 included: a plain target step when nothing pays (where verifying more tokens
    costs far more than one, as on CPUs whose small-batch matmuls are compute-bound). Every
    ``explore_every``-th step drafts the full budget from whichever source offers, so the counts of a
    source the policy stopped using keep updating. Counts start from a Beta(prior * 2, (1 - prior) * 2)
    pseudo-count. Decisions depend only on the calibration and the steps seen: deterministic, so
    replay equals live.

    Args:
        target_s: seconds of a target forward feeding n tokens (``Calibration.target_s``).
        drafter_s: seconds of a drafter forward feeding n tokens (``Calibration.drafter_s``).
        k_max: the longest draft considered.
        explore_every: steps between full-budget steps (0: never).
        prior: the acceptance probability the counts start from.
    """

    learns = True  # its acceptance counts carry over from prompt to prompt

    def __init__(self, target_s, drafter_s, k_max: int = 16, explore_every: int = 8, prior: float = 0.5):
        if not 0.0 < float(prior) < 1.0:
            raise ValueError(f"prior must be in (0, 1), got {prior}")
        self.k_max = int(k_max)
        self.verify_s = [float(target_s(n)) for n in range(1, self.k_max + 2)]  # [n - 1]: n tokens fed
        self.draft_s = float(drafter_s(1))
        self.explore_every = int(explore_every)
        self.prior = float(prior)
        self.counts: dict[str, list[list[float]]] = {}  # source -> per position [accepted, reached]
        self.steps = 0
        self._source = "model"

    def _hazards(self, source: str, n: int) -> list[float]:
        c = self.counts.get(source, [])
        a0, r0 = 2.0 * self.prior, 2.0
        return [(c[i][0] + a0) / (c[i][1] + r0) if i < len(c) else self.prior for i in range(n)]

    def best(self, source: str, available: int, per_token_s: float) -> int:
        """The number of proposals (0..available) with the highest expected tokens per second."""
        best_j, best_rate = 0, 1.0 / self.verify_s[0]
        surv, tokens = 1.0, 1.0
        for j, h in enumerate(self._hazards(source, min(available, self.k_max)), start=1):
            surv *= h
            tokens += surv
            rate = tokens / (per_token_s * j + self.verify_s[j])
            if rate > best_rate:
                best_j, best_rate = j, rate
        return best_j

    def _exploring(self) -> bool:
        return self.explore_every > 0 and self.steps % self.explore_every == self.explore_every - 1

    def lookup_len(self, available: int, n_match: int) -> int:
        self._source = f"lookup{min(int(n_match), 4)}"
        return min(available, self.k_max) if self._exploring() else self.best(self._source, available, 0.0)

    def max_len(self, budget: int) -> int:
        self._source = "model"
        return min(budget, self.k_max) if self._exploring() else self.best("model", budget, self.draft_s)

    def observe(self, fb: StepFeedback) -> None:
        """Count each proposal reached (all before it accepted) and accepted, for the step's source."""
        m, n = len(fb.proposal.ids), fb.n_accepted
        self.steps += 1
        if not m:
            return
        c = self.counts.setdefault(self._source if fb.proposal.source != "model" else "model", [])
        for i in range(min(m, n + 1, self.k_max)):
            while len(c) <= i:
                c.append([0.0, 0.0])
            c[i][1] += 1.0
            c[i][0] += float(i < n)

    def state_dict(self) -> dict:
        return {"counts": self.counts, "steps": self.steps}

    def load_state_dict(self, d: dict) -> None:
        self.counts = {k: [list(map(float, x)) for x in v] for k, v in (d.get("counts") or {}).items()}
        self.steps = int(d.get("steps", 0))
