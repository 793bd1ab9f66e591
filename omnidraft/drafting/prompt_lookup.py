"""Prompt-lookup decoding (PLD): model-free drafting from the context's own n-grams."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from omnidraft.core.feedback import Proposal
from omnidraft.errors import OmniDraftError


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
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise OmniDraftError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.v_t = int(target_vocab_size)
        self.target_eos = set(target_eos)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.ids: list[int] = []
        self.drafted_total = 0
        self.hits = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.ids = list(prompt_ids)

    def _lookup(self, k: int) -> list[int]:
        ids, n_ctx = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ids[n_ctx - n:]
            for s in range(n_ctx - n - 1, -1, -1):  # most recent earlier occurrence first
                if ids[s: s + n] == tail:
                    out = ids[s + n: s + n + k]
                    stop = next((i for i, t in enumerate(out) if t in self.target_eos), None)
                    return out if stop is None else out[: stop + 1]
        return []

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        ids = self._lookup(k) if k > 0 else []
        self.drafted_total += len(ids)
        self.hits += bool(ids)
        q = None
        if temperature > 0 and ids:
            q = torch.zeros(len(ids), self.v_t)
            q[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
        return Proposal(ids, q)

    def commit(self, new_ids: list[int], n_accepted: int) -> None:
        self.ids.extend(new_ids)

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
