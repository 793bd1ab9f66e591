"""The verifier seam of the decode loop: who checks a step's proposals.

:class:`LiveVerifier` runs the target: prefill, then one forward pass over the pending token plus
the proposals per step, greedy or sampling verification (:mod:`omnidraft.core.verify`), and KV
rollback to what was kept. :class:`TraceVerifier` replays a recorded greedy target trajectory
instead (no target forward). Both plug into the same loop through :class:`Verifier`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from omnidraft.choices import REPLAY_ROWS
from omnidraft.core import kv
from omnidraft.core.feedback import Proposal, StepFeedback, Verdict
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
            # on the target's device: the drafter's q is there already (a lookup's one-hot may not be)
            q = proposal.q.to(logits.device) if proposal.q is not None else None  # None: nothing proposed
            n, nxt = sample_verify(probs(logits, temperature), q,
                                   torch.tensor(proposal.ids, dtype=torch.long), generator)
        kv.crop_to(self.cache, kv.cache_len(self.cache) - (m - n))
        return Verdict(n, nxt, logits)


def as_verifier(target) -> Verifier:
    """A verifier as is; a model becomes a :class:`LiveVerifier`."""
    return target if hasattr(target, "verify") and hasattr(target, "start") else LiveVerifier(target)


class TraceVerifier:
    """Greedy verification against the target's recorded greedy trajectory (a target trace), with
    no target forward per step: under greedy verification the proposals a live target accepts are
    exactly the prefix that matches its greedy continuation, and its correction/bonus token is the
    next token of that continuation.

    ``Verdict.rows`` is None. Observers that learn from the target's distributions (online
    distillation, the acceptance head) get them at the end of the generation instead, wrapped by
    :func:`rows_at_end`: given the ``target`` model, :meth:`step_rows` computes every step's rows
    in two batched forwards (the trajectory, then every step's drafted branch off it as a tree),
    the rows live verification would have given. Without a ``target`` such observers refuse.

    Args:
        trajectories: prompt ids (as a tuple) -> the target's greedy output ids after that prompt
            (EOS included when reached), as long as the generation asks for or ending at EOS.
        target: the target model, for the rows of learning observers (None: acceptance only).
        rows: how :meth:`step_rows` computes them: ``batched`` (two forwards per generation; equal
            to live verification's rows up to float rounding; architectures whose layers do not
            all take one attention mask fall back to stepwise) or ``stepwise`` (the live verifier's
            own forwards, one per step, replayed: bit-identical to live on the same machine and
            threads, and as slow as live verification).
        store: where the batched rows' trajectory half is kept between runs (``get(prompt, out)`` ->
            (cache, hidden) or None, ``put(prompt, out, cache, hidden)``; :class:`omnidraft.replay.TrajectoryStore`):
            the trajectory's forward does not depend on the drafter, so every run of a prompt after
            the first loads its key/value cache and last-layer states instead of recomputing them.
    """

    def __init__(self, trajectories: dict[tuple[int, ...], list[int]], target=None, rows: str = "batched",
                 store=None):
        if rows not in REPLAY_ROWS:
            raise ValueError(f"rows must be one of {REPLAY_ROWS}, got {rows!r}")
        self.trajectories = trajectories
        self.target = target
        self.rows = rows
        self.store = store
        self.prompt: list[int] = []
        self.out: list[int] = []
        self.pos = 0
        self.steps: list[tuple[int, list[int], int]] = []  # this generation's (position, proposal ids, accepted)

    def start(self, prompt_ids: list[int]) -> None:
        out = self.trajectories.get(tuple(prompt_ids))
        if out is None:
            raise OmniDraftError(f"the trace has no trajectory for this prompt ({len(prompt_ids)} tokens, "
                                 f"ending {prompt_ids[-5:]}); trace the prompts first (omnidraft trace)")
        self.prompt, self.out, self.pos, self.steps = list(prompt_ids), list(out), 0, []

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
        self.steps.append((pos, list(proposal.ids), n))
        self.pos = pos + n + 1
        return Verdict(n, nxt, None)

    @torch.no_grad()
    def step_rows(self) -> list[torch.Tensor]:
        """The verification rows of every step of the current generation, as live verification
        gives them: row i the target's logits after the pending token and the first i proposals,
        one per proposal (rows 0 .. m-1, what learners read), plus the bonus row m where every
        proposal was accepted (it lies on the trajectory); live verification also computes row m
        of a rejected step, which nothing reads, so the batched rows skip it.

        Rows up to the first rejection lie on the trajectory; the rest on the step's drafted branch
        (the rejected proposal and those after it, but the last). Two forwards in all: the prompt's
        last token and the trajectory after the prefill, then every branch at once with tree
        attention (:func:`omnidraft.core.kv.forward_branches`).
        """
        if self.target is None:
            raise OmniDraftError("this replay has no target model to compute the rows learning observers need: "
                                 "pass the target to TraceVerifier(..., target=model)")
        if not self.steps:
            return []
        model, prompt = self.target, self.prompt
        if self.rows == "stepwise" or not kv.tree_mask_ok(model):  # a custom tree mask needs one mask for all layers
            return self._stepwise_rows()
        need = max(pos + n for pos, _, n in self.steps) + 1  # trajectory rows: after prompt[-1], out[0], ...
        cache, traj = self._trajectory(need)
        base = len(prompt)  # the cache position of out[0]
        # a rejected step's branch: the rejected proposal and those after it but the last (whose row,
        # the bonus row after every proposal, no learner reads); none when the last one was rejected
        branches = [(base + pos + n, ids[n:-1]) for pos, ids, n in self.steps if n < len(ids) - 1]
        logits = iter(kv.forward_branches(model, cache, branches) if branches else [])
        return [self._rows_of_step(traj, next(logits) if n < len(ids) - 1 else None, pos, ids, n)
                for pos, ids, n in self.steps]

    def _trajectory(self, need: int) -> tuple:
        """The key/value cache after the prompt and ``out[:need - 1]``, and the ``need`` trajectory
        rows (logits after ``prompt[-1]``, ``out[0]``, ...): computed, or (with a store) the whole
        trajectory's once, then loaded and cut to ``need``."""
        model, prompt, out = self.target, self.prompt, self.out
        if self.store is None:
            cache = kv.new_cache(model)
            if len(prompt) > 1:
                kv.forward(model, prompt[:-1], cache, keep=1)
            return cache, kv.forward(model, [prompt[-1]] + out[: need - 1], cache)
        got = self.store.get(prompt, out)
        if got is None:
            cache = kv.new_cache(model)
            if len(prompt) > 1:
                kv.forward(model, prompt[:-1], cache, keep=1)
            hidden = kv.forward_states(model, [prompt[-1]] + out, cache)  # every row the trajectory can need
            self.store.put(prompt, out, cache, hidden)
        else:
            cache, hidden = got
        kv.crop_to(cache, len(prompt) + need - 1)
        return cache, kv.logits_of(model, hidden[:need])

    def _stepwise_rows(self) -> list[torch.Tensor]:
        """The live verifier's forwards, replayed: prefill, then per step the pending token and the
        proposals after the kept prefix, and the rollback of the rejected ones."""
        live = LiveVerifier(self.target)
        live.start(self.prompt)
        rows = []
        for pos, ids, n in self.steps:
            pending = self.out[pos - 1] if pos else self.prompt[-1]
            logits = kv.forward(self.target, [pending] + ids, live.cache)
            kv.crop_to(live.cache, kv.cache_len(live.cache) - (len(ids) - n))
            rows.append(logits)
        return rows

    @staticmethod
    def _rows_of_step(traj: torch.Tensor, branch: torch.Tensor | None, pos: int, ids: list[int],
                      n: int) -> torch.Tensor:
        """Step rows: trajectory rows ``pos .. pos + n`` (after the pending token and the accepted
        proposals), then the branch's (after the rejected proposal and each one after it but the last)."""
        rows = traj[pos: pos + n + 1]
        return rows if branch is None else torch.cat([rows, branch])


class RowsAtEnd:
    """Observers that learn from the target's distributions, fed at the end of each generation
    under replay (:class:`TraceVerifier` gives no rows per step).

    Each step's feedback is kept; at :meth:`finish` the verifier computes every step's rows in one
    batch and the wrapped observers see the steps in order, rows filled in, exactly as they would
    have live. Deferring is exact because nothing a learner does changes drafting within a
    generation: drafter, head and optimiser updates happen between prompts.

    Args:
        observers: the learning observers, in order.
        verifier: the replay's :class:`TraceVerifier` (with its target).
    """

    def __init__(self, observers: list, verifier: TraceVerifier):
        self.observers = list(observers)
        self.verifier = verifier
        self.pending: list[StepFeedback] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.pending = []
        for o in self.observers:
            o.start(prompt_ids)

    def observe(self, fb: StepFeedback) -> None:
        self.pending.append(fb)

    def finish(self) -> None:
        rows = self.verifier.step_rows()
        if len(rows) != len(self.pending):
            raise RuntimeError(f"replay recorded {len(rows)} verifications for {len(self.pending)} steps")
        for fb, r in zip(self.pending, rows):
            fb.rows = r
            for o in self.observers:
                o.observe(fb)
        self.pending = []


def rows_at_end(observers: list, verifier) -> list:
    """The observers for a generation verified by ``verifier``: unchanged live; under replay those
    that learn from the target's distributions (``needs_rows``) are moved, in order, into one
    :class:`RowsAtEnd` placed last (observers are independent of one another: only their order
    among themselves matters)."""
    if not isinstance(verifier, TraceVerifier):
        return list(observers)
    learning = [o for o in observers if getattr(o, "needs_rows", False)]
    if not learning:
        return list(observers)
    return [o for o in observers if not getattr(o, "needs_rows", False)] + [RowsAtEnd(learning, verifier)]
