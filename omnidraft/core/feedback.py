"""What one decode step tells its observers (the shape of transformers' ``update_candidate_strategy``,
generalised to several observers).

Each step of :func:`omnidraft.core.decode.generate`: the drafter proposes (:class:`Proposal`, with
the drafter-side record of how it drafted), the verifier checks (:class:`Verdict`), the drafter
syncs its context to the emitted tokens (:class:`TextSync`), then every observer gets one
:class:`StepFeedback`. Observers are the learners: the online distillation learner, the
acceptance-head learner, the draft-length policy, the n-gram cache builder. Drafters only draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnidraft.errors import OmniDraftError


@dataclass(frozen=True)
class Span:
    """One target proposal made from drafter tokens ``drafts[start:end]`` (an n-gram when end - start > 1)."""

    target_id: int
    start: int
    end: int

    @property
    def is_ngram(self) -> bool:
        return self.end - self.start > 1


@dataclass
class Proposal:
    """What a drafter proposes for one step, and how it drafted it.

    Attributes:
        ids: m proposed target-token ids.
        q: (m, V_t) drafter probabilities in target space (sampling only), else None.
        context: the drafter's own context (drafter-vocab ids) before drafting; None for model-free drafters.
        drafts: the drafter tokens behind the proposals (drafter vocabulary).
        spans: per proposal, the drafter-token span it was made from (len m); empty for model-free drafters.
        hidden: (n, H) the drafter's last-layer hidden state at each drafted token, when asked for
            (n >= len(drafts): an n-gram drafter's ``drafts`` stop at the merged proposals' end, its
            hidden states and probabilities cover every token it drafted; spans index into both).
        draft_probs: the drafter's probability of each drafted token at the temperature asked for
            (acceptance-head labels), else None.
        feeds: the tokens each drafter forward of the step fed, in order (the first one what the
            last step emitted, re-tokenised; the others one draft each); empty for model-free
            drafters. With ``fed_hidden``, whether those forwards also returned hidden states: what
            a latency model needs (:class:`omnidraft.calibrate.StepShape`).
        source: where the proposals came from: ``model`` (the drafter LM) or ``lookup`` (the
            context's own n-grams: no drafter forward, no drafting record for learners to use).
    """

    ids: list[int]
    q: torch.Tensor | None = None
    context: list[int] | None = None
    drafts: list[int] = field(default_factory=list)
    spans: Sequence[Span] = ()
    hidden: torch.Tensor | None = None
    draft_probs: list[float] | None = None
    feeds: tuple[int, ...] = ()
    fed_hidden: bool = False
    source: str = "model"


@dataclass
class Verdict:
    """A verifier's answer for one step.

    Attributes:
        n_accepted: proposals accepted (a prefix).
        next_token: the correction at the first rejection, or the bonus token.
        rows: (m+1, V_t) the target's logits after the pending token and after each proposal, or
            None from a verifier that has none (replay from a trace).
    """

    n_accepted: int
    next_token: int
    rows: torch.Tensor | None


@dataclass(frozen=True)
class TextSync:
    """How a cross-vocab drafter re-tokenised the emitted text: ``segment`` (drafter ids) spells
    ``offset`` bytes of already-synced text followed by exactly the emitted tokens' bytes."""

    segment: list[int]
    offset: int


@dataclass
class StepFeedback:
    """One decode step, as its observers see it.

    Attributes:
        proposal: the drafter's proposal with its drafting record.
        rows: (m+1, V_t) verification logits (row i: the target's distribution for proposal i), or
            None when the verifier has none (observers that need them refuse). Rows 0 .. m-1 are
            what observers may read: under replay a rejected step's bonus row m is not computed.
        n_accepted: accepted proposals.
        emitted: target tokens emitted this step (accepted + correction/bonus, cut at EOS / budget).
        temperature: the verification temperature (0 = greedy).
        sync: the drafter's re-tokenisation of ``emitted`` when it lines up byte for byte, else None.
    """

    proposal: Proposal
    rows: torch.Tensor | None
    n_accepted: int
    emitted: list[int]
    temperature: float
    sync: TextSync | None = None


class Observer(Protocol):
    """Learns from steps. ``start`` is called when a prompt begins (after the drafter's), ``observe``
    after every step (after the drafter has synced its context), and ``finish``, where an observer
    has one, when the generation ends. An observer that learns from ``StepFeedback.rows`` says so
    with ``needs_rows = True`` (under replay it is then fed at the end of the generation, rows
    filled in: :func:`omnidraft.core.verifiers.rows_at_end`)."""

    def start(self, prompt_ids: list[int]) -> None: ...

    def observe(self, fb: StepFeedback) -> None: ...


def require_rows(fb: StepFeedback, who: str) -> None:
    """Refuse, in one line, an observer that learns from the target's distributions on a step
    whose verifier gave none (replay from a trace)."""
    if fb.rows is None and fb.proposal.ids:
        raise OmniDraftError(f"{who} learns from the target's distributions, which this verifier does not "
                             "give (replay from a trace): verify live for online adaptation and the acceptance head")
