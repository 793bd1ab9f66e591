"""Prompt-lookup decoding (PLD): model-free drafting from the context's own n-grams.

:class:`ContextLookup` is the lookup itself (an index of the context's n-grams, in target ids);
:class:`PromptLookupDrafter` drafts with it alone, and the model drafters
(:mod:`omnidraft.drafting.model_drafters`) can consult it first as a free draft source.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from omnidraft.core.feedback import Proposal
from omnidraft.errors import OmniDraftError


class ContextLookup:
    """The tokens that followed the most recent earlier occurrence of the context's last n tokens.

    For n = max_ngram down to min_ngram, the last n tokens of the context (prompt + output so far)
    are looked up among its earlier n-grams (an index kept up to date as the context grows, so a
    lookup costs O(max_ngram) dictionary probes, not a scan); the first n that occurred before wins
    and the tokens after its most recent earlier occurrence are the continuation (cut after an EOS).

    Args:
        max_ngram, min_ngram: the n-gram sizes tried, longest first.
        eos: ids after which a continuation is cut (the EOS itself is kept).
    """

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1, eos: set[int] | frozenset = frozenset()):
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise OmniDraftError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.eos = set(eos)
        self.ids: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = []  # per n: n-gram -> start of its latest occurrence
        self._prev: list[dict[tuple[int, ...], int]] = []  # per n: n-gram -> start of the occurrence before

    def reset(self, ids: list[int]) -> None:
        self.ids = []
        self._last = [{} for _ in range(self.max_ngram + 1)]
        self._prev = [{} for _ in range(self.max_ngram + 1)]
        self.extend(ids)

    def extend(self, new: list[int]) -> None:
        ids = self.ids
        for t in new:
            ids.append(int(t))
            end = len(ids)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(ids[end - n:])
                last = self._last[n].get(key)
                if last is not None:
                    self._prev[n][key] = last
                self._last[n][key] = end - n

    def find(self, k: int) -> tuple[list[int], int]:
        """(up to k continuation ids, the n-gram size that matched); ([], 0) when none did."""
        ids, end = self.ids, len(self.ids)
        if k <= 0:
            return [], 0
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            key = tuple(ids[end - n:])
            s = self._last[n].get(key)
            if s == end - n:  # the tail itself: its earlier occurrence is the one before
                s = self._prev[n].get(key)
            if s is None:
                continue
            out = ids[s + n: s + n + k]
            stop = next((i for i, t in enumerate(out) if t in self.eos), None)
            return (out if stop is None else out[: stop + 1]), n
        return [], 0


class PromptLookupDrafter:
    """Prompt-lookup decoding (PLD): model-free drafting in target ids.

    The last ``n`` tokens of the context (prompt + output so far), for n = max_ngram down to
    min_ngram, are searched for in the earlier context; the tokens that followed the most recent
    earlier occurrence are proposed (up to k). The rule of transformers'
    ``PromptLookupCandidateGenerator`` (``max_matching_ngram_size``, default 2) except that the most
    recent occurrence wins (transformers takes the earliest); it runs in this loop so it shares the
    timing and token counting of every other method. Proposals are deterministic, so
    under sampling q is one-hot and standard speculative sampling stays exact.
    """

    def __init__(self, target_vocab_size: int, target_eos: set[int] = frozenset(), max_ngram: int = 2,
                 min_ngram: int = 1):
        self.lookup = ContextLookup(max_ngram, min_ngram, target_eos)
        self.v_t = int(target_vocab_size)
        self.drafted_total = 0
        self.hits = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.reset(prompt_ids)

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        ids, _ = self.lookup.find(k)
        self.drafted_total += len(ids)
        self.hits += bool(ids)
        return Proposal(ids, one_hot(ids, self.v_t) if temperature > 0 and ids else None, source="lookup")

    def commit(self, new_ids: list[int], n_accepted: int) -> None:
        self.lookup.extend(new_ids)

    def stats(self) -> dict[str, float]:
        return {"draft/tokens": self.drafted_total}

    @contextmanager
    def paused(self):
        """Draft without moving the counters (warm-up)."""
        saved = (self.drafted_total, self.hits)
        try:
            yield self
        finally:
            self.drafted_total, self.hits = saved


def one_hot(ids: list[int], v: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(len(ids), v) the distribution of a deterministic proposal, made on ``device``: standard
    speculative sampling with it is exact."""
    q = torch.zeros(len(ids), v, device=device)
    q[torch.arange(len(ids), device=device), torch.tensor(ids, device=device)] = 1.0
    return q
