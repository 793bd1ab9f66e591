"""Drafting strategies behind the :class:`omnidraft.decode.Drafter` interface.

- :class:`SameVocabDrafter`: a small LM sharing the target's tokenizer (standard SD).
- :class:`DirectMapDrafter`: a small LM with its own tokenizer, drafting only tokens that map
  directly into the target vocabulary (SpD_DM / TLI). Its context is kept in sync with the
  target's accepted text by re-tokenising only the changed suffix.

Both keep their own KV cache and crop it to the longest common prefix with the new context.
"""

from __future__ import annotations

import codecs

import torch

from omnidraft import kv
from omnidraft.decode import Proposal
from omnidraft.verify import lift_to_target, probs
from omnidraft.vocab import Retokenizer, VocabBridge


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _ModelDrafter:
    """Autoregressive drafting with a KV cache; subclasses define the vocabulary mapping."""

    def __init__(self, model, target_eos: set[int] = frozenset(), *, allowed: torch.Tensor | None = None):
        self.model = model
        self.target_eos = set(target_eos)
        self._stable = 0  # self.ids[:_stable] is unchanged since the cache was last synced
        self.ids: list[int] = []  # drafter-vocab context
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache
        self.cache = None
        self._mask_add = None
        if allowed is not None:
            v = model.get_output_embeddings().weight.shape[0]
            full = torch.zeros(v, dtype=torch.bool)
            n = min(v, allowed.numel())
            full[:n] = allowed[:n]
            self._mask_add = torch.where(full, 0.0, float("-inf")).to(model.device)

    # -- subclass hooks -------------------------------------------------------------------
    def _to_target(self, d: int) -> int:
        raise NotImplementedError

    def _lift(self, qd: torch.Tensor) -> torch.Tensor:
        """(V_d,) drafter probabilities -> (V_t,) target-space probabilities."""
        raise NotImplementedError

    # -- interface ------------------------------------------------------------------------
    def _reset(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self.cache = kv.new_cache(self.model)
        self.cached = []
        self._stable = 0

    def _sync_cache(self) -> None:
        """Crop the cache to the common prefix with self.ids, keeping >= 1 token to feed."""
        start = min(self._stable, len(self.cached))
        keep = min(_common_prefix(self.cached, self.ids, start), len(self.ids) - 1)
        if keep < len(self.cached):
            kv.crop_to(self.cache, keep)
            del self.cached[keep:]

    @torch.no_grad()
    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        self._sync_cache()
        feed = self.ids[len(self.cached):]
        drafts: list[int] = []
        tids: list[int] = []
        qs: list[torch.Tensor] = []
        for step in range(k):
            logits = kv.forward(self.model, feed, self.cache, keep=1)[-1].float()
            self.cached.extend(feed)
            if self._mask_add is not None:
                logits = logits + self._mask_add
            if temperature <= 0:
                d = int(logits.argmax())
            else:
                qd = probs(logits, temperature).cpu()
                d = int(torch.multinomial(qd, 1, generator=generator))
                qs.append(self._lift(qd))
            drafts.append(d)
            tids.append(self._to_target(d))
            if tids[-1] in self.target_eos:
                break
            feed = [d]
        self._stable = len(self.ids)
        return Proposal(tids, torch.stack(qs) if qs else None)


class SameVocabDrafter(_ModelDrafter):
    """Standard speculative decoding: drafter and target share one tokenizer."""

    def __init__(self, model, target_eos: set[int] = frozenset()):
        super().__init__(model, target_eos)

    def start(self, prompt_ids: list[int]) -> None:
        self._reset(prompt_ids)

    def commit(self, new_ids: list[int], n_accepted: int) -> None:
        self.ids.extend(new_ids)

    def _to_target(self, d: int) -> int:
        return d

    def _lift(self, qd: torch.Tensor) -> torch.Tensor:
        return qd


class DirectMapDrafter(_ModelDrafter):
    """Cross-vocabulary drafter restricted to the directly mapped intersection (SpD_DM).

    Args:
        model: the drafter LM.
        tokenizer: the drafter's tokenizer.
        bridge: the direct map drafter -> target.
        target_vocab_size: V_t of the target's logits (for lifting q in sampling mode).
        target_eos: target EOS ids; drafting stops after proposing one.
        sync_lookbehind: how many already-synced drafter tokens are re-tokenised together with the
            new text, so merges across the boundary come out as the drafter's tokenizer makes them.
    """

    def __init__(self, model, tokenizer, bridge: VocabBridge, target_vocab_size: int,
                 target_eos: set[int] = frozenset(), sync_lookbehind: int = 2):
        super().__init__(model, target_eos, allowed=bridge.draft_mask)
        self.tok = tokenizer
        self.bridge = bridge
        self.v_t = int(target_vocab_size)
        self.lookbehind = int(sync_lookbehind)
        self.retok = Retokenizer(tokenizer, bridge.draft_bytes, bridge.draft_bytes_to_id)
        self._map_ids = torch.nonzero(bridge.draft_mask).squeeze(1)
        self._map_tgt = bridge.d2t[self._map_ids]

    def start(self, prompt_ids: list[int]) -> None:
        # The drafter reads the same text as the target (chat markers included), in its own tokens.
        text = self.bridge.target_text_bytes(prompt_ids).decode("utf-8", errors="replace")
        d_prompt = self.tok.encode(text, add_special_tokens=True)
        self._reset(d_prompt)
        self.n_prompt = len(d_prompt)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def commit(self, new_ids: list[int], n_accepted: int) -> None:
        """Append the target's new text: re-tokenise the last few drafter tokens + the new text."""
        text = self._utf8.decode(self.bridge.target_text_bytes(new_ids))
        if not text:
            return  # an incomplete UTF-8 sequence: wait for the rest
        r = min(self.lookbehind, len(self.ids) - self.n_prompt)
        head = self.ids[: len(self.ids) - r]
        tail_bytes = self.retok.spelled(self.ids[len(self.ids) - r:]) if r else b""
        tail_text = tail_bytes.decode("utf-8", errors="ignore") if r else ""
        if r and tail_text.encode("utf-8") != tail_bytes:  # tail splits a character: keep it
            head, tail_text = self.ids, ""
        self._stable = len(head)
        self.ids = head + self.retok.encode(tail_text + text)

    def _to_target(self, d: int) -> int:
        return self.bridge.to_target(d)

    def _lift(self, qd: torch.Tensor) -> torch.Tensor:
        return lift_to_target(qd, self._map_ids, self._map_tgt, self.v_t)
