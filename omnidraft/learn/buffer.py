"""The online learner's training data: one :class:`Example` per speculative step.

Data is on-policy: each step's drafter context, drafted tokens and the target's distributions at
the proposed positions, taken from the verification pass already computed (no extra target
forward). Mini-batches are runs of up to ``batch_size`` consecutive steps of one prompt (their order
shuffled), so each batch computes its shared context once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from omnidraft.core.feedback import Span


@dataclass
class Example:
    """One speculative step, as training data.

    Attributes:
        seq: which generation (prompt) of the buffer it comes from.
        ctx: drafter context before drafting.
        drafts: drafter tokens behind the merged proposals.
        dm_pos: draft positions whose proposal is a directly mapped token.
        dm_logp: (len(dm_pos), C) target log-probabilities over the reachable target tokens.
        dm_top: per DM position, the column of the target's argmax, or -1 if the drafter cannot
            reach it (used by the ``nll_nll`` loss).
        ngrams: (start, end, target log-prob of the n-gram's token) of n-grams the target accepted.
        head: (start, end, label) per target proposal up to and including the first rejection, for
            an acceptance head trained jointly (:meth:`OnlineLearner.attach_head`); empty otherwise.
    """

    seq: int
    ctx: list[int]
    drafts: list[int]
    dm_pos: list[int]
    dm_logp: torch.Tensor
    dm_top: list[int] = field(default_factory=list)
    ngrams: list[tuple[int, int, float]] = field(default_factory=list)
    head: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def ng_pos(self) -> list[int]:
        return [j for s, e, _ in self.ngrams for j in range(s, e)]


def make_example(seq: int, ctx: list[int], drafts: list[int], spans: Sequence[Span], rows: torch.Tensor,
                 n_accepted: int, cols: torch.Tensor, positions: str = "drafted",
                 head_spans: list[tuple[int, int, float]] | None = None) -> Example | None:
    """One step as an :class:`Example`, or None when it holds nothing to train on.

    Args:
        spans: the step's proposals (drafter-token span and target id each).
        rows: (>= len(spans), V_t) target logits; row i is the distribution for proposal i.
        cols: (C,) sorted target ids the drafter can reach through the direct map.
        positions: 'drafted' (every directly mapped proposal) or 'rejected' (only the first
            rejected proposal: Online Speculative Decoding's data).
        head_spans: (start, end, label) for a jointly trained acceptance head.
    """
    if not spans:
        return None
    head_spans = head_spans or []
    dm_rows, dm_pos, ng_rows = [], [], []
    for i, m in enumerate(spans):
        if positions == "rejected" and i != n_accepted:
            continue  # OSD: only the first rejected proposal (none when all were accepted)
        if m.is_ngram:
            if i < n_accepted:
                ng_rows.append(i)
        else:
            dm_rows.append(i)
            dm_pos.append(m.start)
    if not dm_rows and not ng_rows and not head_spans:
        return None
    # Normalise only the rows kept (a full-vocabulary log-softmax per row is the costly part).
    ng_logp = torch.log_softmax(rows[ng_rows].float(), -1) if ng_rows else None
    ngrams = [(spans[i].start, spans[i].end, float(ng_logp[r, spans[i].target_id])) for r, i in enumerate(ng_rows)]
    dm_all = torch.log_softmax(rows[dm_rows].float(), -1)
    cols = cols.to(rows.device)
    logp = dm_all[:, cols]
    top = dm_all.argmax(-1)
    col = torch.searchsorted(cols, top).clamp(max=len(cols) - 1)
    dm_top = torch.where(cols[col] == top, col, -1).tolist()
    # kept where the target computed it (no per-step copy of the mapped-vocabulary rows to the host on a
    # GPU); checkpoints move it to the CPU when they save it
    return Example(seq, list(ctx), list(drafts), dm_pos, logp.to(torch.float16), dm_top, ngrams, head_spans)


def batches(buffer: list[Example], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Runs of <= batch_size consecutive examples of one sequence, in shuffled order."""
    out: list[list[int]] = []
    for i, ex in enumerate(buffer):
        if out and len(out[-1]) < batch_size and buffer[out[-1][-1]].seq == ex.seq:
            out[-1].append(i)
        else:
            out.append([i])
    rng.shuffle(out)
    return out
