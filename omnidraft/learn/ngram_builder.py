"""The n-gram cache builder: the observer that fills OmniDraft's online n-gram cache.

After each step the drafter has re-tokenised the emitted target text in its own vocabulary
(:class:`omnidraft.core.feedback.TextSync`); every emitted target token spelled exactly by a run of
>= 2 drafter tokens becomes a cache entry (drafter sub-tokens -> target token), which the drafter
may propose from the next step on (:meth:`omnidraft.drafting.model_drafters.NgramDrafter.allow`).
"""

from __future__ import annotations

from omnidraft.core.feedback import StepFeedback
from omnidraft.drafting.ngram_cache import alignments


class NgramCacheBuilder:
    """Fills ``drafter.ngram`` from each step's feedback.

    Args:
        drafter: an :class:`omnidraft.drafting.model_drafters.NgramDrafter` (its cache, bridge, and
            ``allow`` / ``refresh_mask`` for the tokens it may draft).
    """

    def __init__(self, drafter):
        self.drafter = drafter

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def observe(self, fb: StepFeedback) -> None:
        if fb.sync is None:
            return  # this step's text does not line up with its target tokens byte for byte
        d, bridge = self.drafter, self.drafter.bridge
        evicted = False
        for t, seq in alignments(fb.emitted, bridge.target_bytes, fb.sync.segment, bridge.draft_bytes,
                                 fb.sync.offset):
            n_before = len(d.ngram)
            if d.ngram.add(t, seq):
                d.allow(seq)
                evicted |= len(d.ngram) == n_before
        if evicted:
            d.refresh_mask()  # an evicted entry's sub-tokens may no longer be allowed
