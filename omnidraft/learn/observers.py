"""Wiring a model drafter to the observers that learn from its steps, in the one canonical order.

The decode loop hands each step's feedback to its observers in order; the order is the one the
learners were designed with: the draft-length policy, the acceptance-head learner, the online
distillation learner, the n-gram cache builder.
"""

from __future__ import annotations

from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.learn.ngram_builder import NgramCacheBuilder


def use_length_policy(drafter, policy) -> None:
    """Make ``drafter`` consult ``policy`` (FixedK / HeuristicK / HeadPolicy) while drafting; the
    policy observes the steps when passed to :func:`step_observers`."""
    drafter.policy = policy


def step_observers(drafter, *, policy=None, head=None, learner=None) -> list:
    """The observers of ``drafter``'s steps: ``policy`` (its draft-length policy), ``head`` (the
    acceptance-head learner), ``learner`` (online distillation), and the n-gram cache builder when
    the drafter is an :class:`NgramDrafter` that learns its cache. None entries are left out. A
    ``head`` makes the drafter record what it trains on (hidden states, token probabilities)."""
    if head is not None:
        drafter.record_hidden, drafter.token_probs = True, head.label
    builder = NgramCacheBuilder(drafter) if isinstance(drafter, NgramDrafter) and drafter.learn else None
    return [o for o in (policy, head, learner, builder) if o is not None]
