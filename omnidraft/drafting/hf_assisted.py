"""transformers' own assisted generation as a baseline (``uag``, ``uag_k5``), measured like every
other method. (With a drafter that shares the target's tokenizer it is plain assisted generation.)
Without an assistant (``hf_ar``) it is transformers' plain greedy ``generate``: the loop uag runs
in, so ``uag`` vs ``hf_ar`` separates the drafting gain from the two loops' own costs.

With two tokenizers, ``model.generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)``
runs transformers' cross-tokenizer assisted generation (greedy: text re-encoding between the two
vocabularies; sampling: Universal Assisted Generation). Its draft length is read from the
assistant's ``generation_config`` (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``), which is where this module sets it.

Token counting is the harness's: new target tokens, EOS included, over the wall time of the whole
call. Per-step statistics come from PyTorch forward hooks on the target (public API, nothing is
patched): each target forward is one verification step; the tokens it proposes and accepts follow
from its input length and the KV length transformers keeps (it crops the cache to the accepted
sequence minus its last token after every step). There is no separate prefill: transformers feeds
the prompt together with the first candidates, so that step's target time includes the prompt.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch

from omnidraft.core.decode import GenerationResult, StepRecord


class HFAssisted:
    """One configured transformers assistant (its own generation config object, so the
    ``heuristic`` schedule's state persists across calls exactly as transformers intends).

    Args:
        num_assistant_tokens / num_assistant_tokens_schedule / assistant_confidence_threshold:
            set on the assistant's generation config; None keeps transformers' default.
    """

    def __init__(self, target, assistant, target_tokenizer, assistant_tokenizer=None, *,
                 num_assistant_tokens: int | None = None, num_assistant_tokens_schedule: str | None = None,
                 assistant_confidence_threshold: float | None = None):
        self.target, self.assistant = target, assistant
        self.target_tokenizer, self.assistant_tokenizer = target_tokenizer, assistant_tokenizer
        self.assistant_config, self.same_tokenizer = None, True
        if assistant is None:  # hf_ar: plain generate
            return
        gc = copy.deepcopy(assistant.generation_config)
        for key, v in (("num_assistant_tokens", num_assistant_tokens),
                       ("num_assistant_tokens_schedule", num_assistant_tokens_schedule),
                       ("assistant_confidence_threshold", assistant_confidence_threshold)):
            if v is not None:
                setattr(gc, key, v)
        self.assistant_config = gc
        from omnidraft.drafting.direct_map import tokenizer_hash
        from omnidraft.errors import OmniDraftError

        # transformers treats equal vocabulary sizes as one tokenizer (plain assisted generation)
        # and different sizes as two (text re-encoding); a pair it would misread is refused here.
        v_t = target.config.get_text_config().vocab_size
        v_a = assistant.config.get_text_config().vocab_size
        same_tok = tokenizer_hash(target_tokenizer) == tokenizer_hash(assistant_tokenizer)
        if v_t == v_a and not same_tok:
            raise OmniDraftError(f"transformers' assisted generation takes two models with equal vocabulary sizes "
                                 f"({v_t}) to share a tokenizer, but these tokenizers differ: the uag baselines "
                                 "cannot run on this pair")
        self.same_tokenizer = v_t == v_a

    @contextmanager
    def paused(self):
        """Warm-up: transformers' heuristic draft length is restored afterwards."""
        saved = copy.deepcopy(self.assistant_config)
        try:
            yield self
        finally:
            self.assistant_config = saved

    def state_dict(self) -> dict:
        """What transformers' ``heuristic`` schedule carries from one call to the next."""
        return {} if self.assistant_config is None else {"num_assistant_tokens": self.assistant_config.num_assistant_tokens}

    def load_state_dict(self, d: dict) -> None:
        if self.assistant_config is not None and "num_assistant_tokens" in d:
            self.assistant_config.num_assistant_tokens = d["num_assistant_tokens"]

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> GenerationResult:
        if temperature > 0:
            raise ValueError("the uag baselines run greedy (method.temperature=0)")
        eos = sorted(eos_ids)
        # Explicit greedy settings: a target's own generation_config (sampling, repetition penalty)
        # must not make this baseline decode differently from ar.
        gen = dict(do_sample=False, max_new_tokens=int(max_new_tokens), eos_token_id=eos or None,
                   pad_token_id=eos[0] if eos else 0, repetition_penalty=1.0, num_beams=1)
        calls: list[list[float]] = []

        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            pkv = kwargs.get("past_key_values", kwargs.get("cache"))
            past = pkv.get_seq_length() if pkv is not None and hasattr(pkv, "get_seq_length") else 0
            calls.append([int(ids.shape[1]), int(past), time.perf_counter(), 0.0])

        def post(module, args, kwargs, out):
            calls[-1][3] = time.perf_counter()

        x = torch.tensor([prompt_ids], device=self.target.device)
        assist = {}
        if self.assistant is not None:
            saved = self.assistant.generation_config
            self.assistant.generation_config = self.assistant_config
            assist = {"assistant_model": self.assistant}
            if not self.same_tokenizer:
                assist.update(tokenizer=self.target_tokenizer, assistant_tokenizer=self.assistant_tokenizer)
        handles = [self.target.register_forward_pre_hook(pre, with_kwargs=True),
                   self.target.register_forward_hook(post, with_kwargs=True)]
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = self.target.generate(x, attention_mask=torch.ones_like(x), **gen, **assist)
            wall = time.perf_counter() - t0
        finally:
            for h in handles:
                h.remove()
            if self.assistant is not None:
                self.assistant.generation_config = saved
        tokens = seq[0, len(prompt_ids):].tolist()
        res = GenerationResult(tokens=tokens, wall_s=wall, prefill_s=0.0)
        res.steps = steps_from_calls(calls, len(prompt_ids), len(tokens), t0)
        res.stop = "eos" if tokens and tokens[-1] in eos_ids else "length"
        return res


def steps_from_calls(calls: list[list[float]], n_prompt: int, n_new: int, t_start: float) -> list[StepRecord]:
    """Reconstruct per-step records from target forward calls [input_len, past_len, t_in, t_out].

    Before call i the known sequence is prompt + E_i emitted tokens, of which ``past`` are cached;
    the rest of its input are candidates: m_i = past_i + len_i - (P + E_i). After a step,
    transformers keeps P + E_{i+1} - 1 positions, so E_{i+1} = past_{i+1} + 1 - P.
    """
    steps: list[StepRecord] = []
    emitted = 0
    t_prev = t_start
    for i, (n_in, past, t_in, t_out) in enumerate(calls):
        m = max(0, int(past + n_in - (n_prompt + emitted)))
        nxt = n_new if i + 1 == len(calls) else int(calls[i + 1][1]) + 1 - n_prompt
        e = max(0, min(nxt, n_new) - emitted)
        n_acc = max(0, min(m, e - 1))
        steps.append(StepRecord(m, n_acc, e, t_in - t_prev, t_out - t_in))
        emitted += e
        t_prev = t_out
    return steps
