"""Model drafters behind the :class:`omnidraft.core.decode.Drafter` interface.

- :class:`SameVocabDrafter`: a small LM sharing the target's tokenizer (standard SD).
- :class:`DirectMapDrafter`: a small LM with its own tokenizer, drafting only tokens that map
  directly into the target vocabulary (SpD_DM / TLI). Its context is kept in sync with the
  target's accepted text by re-tokenising only the changed suffix.
- :class:`NgramDrafter`: DirectMapDrafter + the online n-gram cache: drafter tokens merge into
  cached n-gram target tokens (the cache is filled by an observer,
  :class:`omnidraft.learn.ngram_builder.NgramCacheBuilder`).

Prompt lookup (model-free) is in :mod:`omnidraft.drafting.prompt_lookup`. Every model drafter can
consult it first (``lookup_min_match`` > 0): where the context's last n >= lookup_min_match target
tokens occurred before, the tokens that followed are proposed and the drafter LM does not run that
step (a free draft source; the proposals are verified like any other, so greedy output is unchanged).

They keep their own KV cache and crop it to the longest common prefix with the new context.
Drafters only draft: each proposal carries the record of how it was drafted (context, drafter
tokens, their spans, and on request hidden states and token probabilities), which the decode loop
hands to the observers that learn (online distillation, acceptance head, draft-length policy,
n-gram cache builder). No drafter imports a learner.
"""

from __future__ import annotations

import codecs
from contextlib import contextmanager

import torch

from omnidraft.choices import VERIFY_RULES
from omnidraft.core import kv
from omnidraft.core.feedback import Proposal, Span, TextSync
from omnidraft.core.verify import lift_to_target, probs, sample_index
from omnidraft.drafting.direct_map import Retokenizer, VocabBridge
from omnidraft.drafting.ngram_cache import NgramCache
from omnidraft.drafting.prompt_lookup import ContextLookup, one_hot
from omnidraft.errors import OmniDraftError


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class FixedLength:
    """The default draft length: always the step's budget. The interface a draft-length policy
    offers the drafter (:mod:`omnidraft.learn.draft_length` adds the observing side)."""

    needs_hidden = False
    needs_prob = False  # keep_going wants each drafted token's drafter probability

    def max_len(self, budget: int) -> int:
        return budget

    def lookup_len(self, available: int, n_match: int) -> int:
        """How many of the ``available`` prompt-lookup proposals (after an ``n_match``-token match)
        to propose; 0: let the drafter LM draft instead."""
        return available

    def begin(self) -> None:
        pass

    def keep_going(self, hidden, prob: float | None = None) -> bool:
        """After each drafted token: its last-layer hidden state (``needs_hidden``) and its drafter
        probability (``needs_prob``; at the sampling temperature, greedy: at T=1)."""
        return True


class _ModelDrafter:
    """Autoregressive drafting with a KV cache; subclasses define the vocabulary mapping.

    Attributes set by the session (what the observers need recorded):
        policy: the draft-length policy consulted while drafting (``max_len``, ``begin``,
            ``keep_going(hidden, prob)``); fixed k by default.
        record_hidden: record the last-layer hidden state of every drafted token (acceptance head).
        token_probs: None, or 'verify' / 't1': record each drafted token's probability at the
            verification temperature / at T=1 (acceptance-head labels; nothing at greedy 'verify').

    Args (the free draft source, every subclass):
        lookup_min_match: 0 (off), or the shortest n-gram of the context's last target tokens whose
            earlier occurrence makes the step propose what followed it instead of running the LM.
        lookup_max_ngram: the longest n-gram tried (longest first).
        model_k: None, or a cap on the drafter LM's tokens per step below the step's budget k, so
            lookup proposals (free to draft) can be longer than the LM's (method.k bounds both).
    """

    def __init__(self, model, target_eos: set[int] = frozenset(), *, allowed: torch.Tensor | None = None,
                 lookup_min_match: int = 0, lookup_max_ngram: int = 4, model_k: int | None = None):
        if model_k is not None and int(model_k) < 1:
            raise OmniDraftError(f"model_k={model_k}: use null (the step's k) or a draft length >= 1")
        self.model_k = None if model_k is None else int(model_k)
        self.lookup = ContextLookup(max(int(lookup_max_ngram), int(lookup_min_match)), int(lookup_min_match),
                                    target_eos) if int(lookup_min_match) > 0 else None
        self.lookup_steps = 0
        self.lookup_tokens = 0
        self.model = model
        self.target_eos = set(target_eos)
        self._stable = 0  # self.ids[:_stable] is unchanged since the cache was last synced
        self.ids: list[int] = []  # drafter-vocab context
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache
        self.cache = None
        self._mask_add = None
        self.policy = FixedLength()
        self.record_hidden = False
        self.token_probs: str | None = None
        self.last_drafts: list[int] = []
        self.drafted_total = 0
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

    @contextmanager
    def paused(self):
        """Draft without moving the counters (warm-up): the stream's statistics are as before afterwards."""
        saved = (self.drafted_total, self.lookup_steps, self.lookup_tokens)
        try:
            yield self
        finally:
            self.drafted_total, self.lookup_steps, self.lookup_tokens = saved

    # -- the free draft source ----------------------------------------------------------------
    def start(self, prompt_ids: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.reset(prompt_ids)
        self._start(prompt_ids)

    def commit(self, new_ids: list[int], n_accepted: int) -> TextSync | None:
        if self.lookup is not None:
            self.lookup.extend(new_ids)
        return self._commit(new_ids, n_accepted)

    def _start(self, prompt_ids: list[int]) -> None:
        raise NotImplementedError

    def _commit(self, new_ids: list[int], n_accepted: int) -> TextSync | None:
        raise NotImplementedError

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        """The lookup's continuation where the context's last tokens occurred before (no LM forward),
        else the drafter LM's proposal."""
        if self.lookup is not None:
            ids, n_match = self.lookup.find(k)
            ids = ids[: self.policy.lookup_len(len(ids), n_match)] if ids else ids
            if ids:
                self.lookup_steps += 1
                self.lookup_tokens += len(ids)
                return Proposal(ids, one_hot(ids, self.v_t, self.model.device) if temperature > 0 else None,
                                source="lookup")
        return self._propose(k, temperature, generator)

    @torch.no_grad()
    def _draft(self, k: int, temperature: float, generator: torch.Generator | None
               ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[float] | None]:
        """Up to k drafter tokens (greedy or sampled, under the mask), their drafter-space
        distributions (sampling only), hidden states and token probabilities (when recorded).
        Stops after a token that maps to a target EOS, or where the draft-length policy says so."""
        self._sync_cache()
        feed = self.ids[len(self.cached):]
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        want_hidden = self.policy.needs_hidden or self.record_hidden
        # the head's labels follow the verification temperature ('verify') or T=1 ('t1')
        label_t = 1.0 if self.token_probs == "t1" else temperature
        tok_p: list[float] | None = [] if self.token_probs is not None and label_t > 0 else None
        self.policy.begin()
        feeds: list[int] = []
        for _ in range(self.policy.max_len(k if self.model_k is None else min(k, self.model_k))):
            feeds.append(len(feed))
            if want_hidden:
                logits, h = kv.forward_hidden(self.model, feed, self.cache)
                logits = logits.float()
                hidden.append(h.float())
            else:
                logits, h = kv.forward(self.model, feed, self.cache, keep=1)[-1].float(), None
            self.cached.extend(feed)
            if self._mask_add is not None:
                logits = logits + self._mask_add
            if temperature <= 0:
                d = int(logits.argmax())
            else:
                qd = probs(logits, temperature)  # stays on the drafter's device
                d = sample_index(qd, generator)
                qs.append(qd)
            if tok_p is not None:
                tok_p.append(float(qd[d]) if label_t == temperature else float(torch.softmax(logits, -1)[d]))
            p_d = None
            if self.policy.needs_prob:
                p_d = float(qd[d]) if temperature > 0 else float(torch.softmax(logits, -1)[d])
            drafts.append(d)
            if self._to_target(d) in self.target_eos or not self.policy.keep_going(h, p_d):
                break
            feed = [d]
        self._stable = len(self.ids)
        self.last_drafts = drafts
        self.last_feeds = tuple(feeds)
        self.drafted_total += len(drafts)
        return drafts, qs, hidden, tok_p

    def stats(self) -> dict[str, float]:
        """Cumulative counters (the runner logs per-prompt differences)."""
        out = {"draft/tokens": self.drafted_total}
        if self.lookup is not None:
            out.update({"draft/lookup_steps": self.lookup_steps, "draft/lookup_tokens": self.lookup_tokens})
        return out

    def _propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        ctx = list(self.ids)
        drafts, qs, hidden, tok_p = self._draft(k, temperature, generator)
        q = torch.stack([self._lift(x) for x in qs]) if qs else None
        spans = [Span(self._to_target(d), i, i + 1) for i, d in enumerate(drafts)]
        return Proposal([s.target_id for s in spans], q, ctx, drafts, spans,
                        torch.stack(hidden) if hidden else None, tok_p, self.last_feeds, bool(hidden))


class SameVocabDrafter(_ModelDrafter):
    """Standard speculative decoding: drafter and target share one tokenizer."""

    def __init__(self, model, target_eos: set[int] = frozenset(), target_vocab_size: int | None = None,
                 lookup_min_match: int = 0, lookup_max_ngram: int = 4, model_k: int | None = None):
        # One tokenizer, but the two embedding matrices may be padded to different sizes
        # (Qwen2.5-0.5B 151936 rows, 7B 152064): drafter ids the target's logits lack are never drafted.
        v_d = int(model.get_output_embeddings().weight.shape[0])
        self.v_t = int(target_vocab_size or v_d)
        super().__init__(model, target_eos, allowed=torch.arange(v_d) < self.v_t if self.v_t < v_d else None,
                         lookup_min_match=lookup_min_match, lookup_max_ngram=lookup_max_ngram, model_k=model_k)

    def _start(self, prompt_ids: list[int]) -> None:
        self._reset(prompt_ids)

    def _commit(self, new_ids: list[int], n_accepted: int) -> None:
        self.ids.extend(new_ids)

    def _to_target(self, d: int) -> int:
        return d

    def _lift(self, qd: torch.Tensor) -> torch.Tensor:
        if qd.numel() == self.v_t:
            return qd
        out = qd.new_zeros(self.v_t)  # pad (or cut: the mask keeps q's mass below v_t) to the target's size
        n = min(self.v_t, qd.numel())
        out[:n] = qd[:n]
        return out


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
        lookup_min_match, lookup_max_ngram, model_k: the free draft source (:class:`_ModelDrafter`).
    """

    def __init__(self, model, tokenizer, bridge: VocabBridge, target_vocab_size: int,
                 target_eos: set[int] = frozenset(), sync_lookbehind: int = 2, lookup_min_match: int = 0,
                 lookup_max_ngram: int = 4, model_k: int | None = None):
        super().__init__(model, target_eos, allowed=bridge.draft_mask, lookup_min_match=lookup_min_match,
                         lookup_max_ngram=lookup_max_ngram, model_k=model_k)
        self.tok = tokenizer
        self.bridge = bridge
        self.v_t = int(target_vocab_size)
        self.lookbehind = int(sync_lookbehind)
        self.retok = Retokenizer(tokenizer, bridge.draft_bytes, bridge.draft_bytes_to_id)
        self._map_ids = torch.nonzero(bridge.draft_mask).squeeze(1).to(model.device)
        self._map_tgt = bridge.d2t[self._map_ids.cpu()].to(model.device)

    def _start(self, prompt_ids: list[int]) -> None:
        # The drafter reads the same text as the target (chat markers included), in its own tokens.
        text = self.bridge.target_text_bytes(prompt_ids).decode("utf-8", errors="replace")
        d_prompt = self.tok.encode(text, add_special_tokens=True)
        self._reset(d_prompt)
        self.n_prompt = len(d_prompt)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _commit(self, new_ids: list[int], n_accepted: int) -> TextSync | None:
        """Append the target's new text: re-tokenise the last few drafter tokens + the new text.

        Returns the re-tokenised segment when it spells (already-synced tail + exactly the new
        tokens' bytes), so observers can align drafter and target tokens; None when the text does
        not line up byte for byte (a UTF-8 character split across steps)."""
        pending_before = self._utf8.getstate()[0]
        text = self._utf8.decode(self.bridge.target_text_bytes(new_ids))
        if not text:
            return None  # an incomplete UTF-8 sequence: wait for the rest
        r = min(self.lookbehind, len(self.ids) - self.n_prompt)
        head = self.ids[: len(self.ids) - r]
        tail_bytes = self.retok.spelled(self.ids[len(self.ids) - r:]) if r else b""
        tail_text = tail_bytes.decode("utf-8", errors="ignore") if r else ""
        if r and tail_text.encode("utf-8") != tail_bytes:  # tail splits a character: keep it
            head, tail_text = self.ids, ""
        self._stable = len(head)
        self.ids = head + self.retok.encode(tail_text + text)
        if pending_before or self._utf8.getstate()[0]:
            return None
        seg = self.ids[self._stable:]
        offset = len(self.retok.spelled(seg)) - len(self.bridge.target_text_bytes(new_ids))
        return TextSync(seg, offset) if offset >= 0 else None

    def _to_target(self, d: int) -> int:
        return self.bridge.to_target(d)

    def _lift(self, qd: torch.Tensor) -> torch.Tensor:
        return lift_to_target(qd, self._map_ids, self._map_tgt, self.v_t)


class NgramDrafter(DirectMapDrafter):
    """Cross-vocabulary drafter with the online n-gram cache (OmniDraft's drafting side).

    The drafter may propose directly mapped tokens and the sub-tokens of cached n-grams; its k
    drafter tokens are merged (longest match) into m <= k target proposals. The cache is filled by
    an observer (:class:`omnidraft.learn.ngram_builder.NgramCacheBuilder`: every accepted target
    token spelled by >= 2 drafter tokens in context), which tells the drafter what it may now draft
    (:meth:`allow`, :meth:`refresh_mask`).

    Verification (``verify``):
      - ``lossless``: greedy only; the target checks every merged proposal by argmax, so the
        output equals plain target decoding.
      - ``paper``: OmniDraft's sampling rule. q'(t) of an n-gram token is the PRODUCT of its
        sub-tokens' conditionals; q' at that position is the lifted first-position distribution
        with the product put on the n-gram token and taken off its first sub-token's image
        (q(d1) - product). Accept with min(1, p/q'), resample from norm(max(0, p - q')). This is
        approximate: NOT lossless under sampling. At temperature 0 both modes are the argmax test.

    Args:
        learn: whether the cache is filled online (False: OSD, which drafts directly mapped tokens
            only); read by :func:`omnidraft.learn.observers.step_observers` when it attaches the builder.
    """

    def __init__(self, model, tokenizer, bridge: VocabBridge, target_vocab_size: int,
                 target_eos: set[int] = frozenset(), sync_lookbehind: int = 2,
                 ngram: NgramCache | None = None, learn: bool = True,
                 verify: str = "lossless", capacity: int | None = None, eviction: str = "lru",
                 lookup_min_match: int = 0, lookup_max_ngram: int = 4, model_k: int | None = None):
        super().__init__(model, tokenizer, bridge, target_vocab_size, target_eos, sync_lookbehind,
                         lookup_min_match=lookup_min_match, lookup_max_ngram=lookup_max_ngram, model_k=model_k)
        if verify not in VERIFY_RULES:
            raise OmniDraftError(f"verify={verify!r}: use 'lossless' (greedy, exact) or 'paper' (OmniDraft's q' rule)")
        self.ngram = ngram if ngram is not None else NgramCache(capacity=capacity, eviction=eviction)
        self.learn = learn
        self.verify = verify
        self._base_mask = self._mask_add.clone()
        self.hits_total = 0
        self.last_merged = []
        self.refresh_mask()

    def allow(self, seq) -> None:
        """Let the drafter draft the sub-tokens of ``seq`` (a new cache entry)."""
        idx = torch.tensor([d for d in seq if d < self._mask_add.numel()], dtype=torch.long)
        if idx.numel():
            self._mask_add[idx.to(self._mask_add.device)] = 0.0

    def refresh_mask(self) -> None:
        """Allowed drafter tokens: directly mapped ones + sub-tokens of current cache entries."""
        self._mask_add.copy_(self._base_mask)
        for seq in list(self.ngram._by_seq):
            self.allow(seq)

    def _propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        if temperature > 0 and self.verify == "lossless":
            raise OmniDraftError("sampling with the n-gram cache has no lossless rule; set method.verify=paper "
                                 "(OmniDraft's approximate q') or method.temperature=0")
        ctx = list(self.ids)
        drafts, qs, hidden, tok_p = self._draft(k, temperature, generator)
        merged = self.ngram.merge(drafts, self.bridge.to_target)
        self.last_merged = merged  # for inspection (last_drafts is set by _draft)
        self.hits_total += sum(m.is_ngram for m in merged)
        q = torch.stack([self._q_prime(m, drafts, qs) for m in merged]) if qs and merged else None
        spans = [Span(m.target_id, m.start, m.end) for m in merged]
        return Proposal([s.target_id for s in spans], q, ctx, drafts[: merged[-1].end] if merged else [], spans,
                        torch.stack(hidden) if hidden else None, tok_p, self.last_feeds, bool(hidden))

    def _q_prime(self, m, drafts: list[int], qs: list[torch.Tensor]) -> torch.Tensor:
        """The paper's q' for one merged proposal, in target space."""
        row = self._lift(qs[m.start])
        if not m.is_ngram:
            return row
        prod = 1.0
        for j in range(m.start, m.end):
            prod *= float(qs[j][drafts[j]])
        row[m.target_id] += prod  # the product rule (added to any directly mapped mass of t)
        first = self.bridge.to_target(drafts[m.start])
        if first >= 0:
            row[first] = (row[first] - prod).clamp_min(0.0)
        return row

    def stats(self) -> dict[str, float]:
        """Cumulative statistics over the stream (the runner logs per-prompt differences)."""
        return {**super().stats(), **self.ngram.stats(), "ngram/proposed_hits": self.hits_total}

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"ngram": self.ngram.state_dict(), "hits_total": self.hits_total}

    def load_state_dict(self, d: dict) -> None:
        self.ngram = NgramCache.from_state_dict(d["ngram"])
        self.hits_total = int(d.get("hits_total", 0))
        self.refresh_mask()

    @contextmanager
    def paused(self):
        """Draft without touching the stream's cache or counters (warm-up): observers are off then,
        so the cache is not filled, and drafting on a copy keeps its lookup statistics and its
        LRU / LFU order (merging touches entries) as they were."""
        saved, self.ngram = (self.ngram, self.hits_total), NgramCache.from_state_dict(self.ngram.state_dict())
        try:
            with super().paused():
                yield self
        finally:
            self.ngram, self.hits_total = saved
            self.refresh_mask()
