"""Python API: build a decoder from config names, or from transformers model and tokenizer
objects (the shape of transformers' assisted generation), and call it on prompts.

    from omnidraft.api import load
    dec = load(target="qwen25_coder_05b", drafter="smollm2_135m", method="omnidraft")
    for q in questions:                      # adapts online: an update every method.adapt.interval calls
        out = dec.generate_text(q)
    out.text, out.result.accepted, out.result.proposed, dec.stats()

    from omnidraft.api import from_models   # any HF causal LMs, tokenizers may differ
    dec = from_models(target, target_tok, drafter, drafter_tok, method="omnidraft")
    ids = dec.generate(input_ids, max_new_tokens=128)   # == target.generate(input_ids, do_sample=False, ...)
    dec.save_pretrained("my_drafter")        # from_pretrained-loadable drafter + its n-gram caches / heads
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from omnidraft import state as state_io
from omnidraft.config import CONF_DIR, register_configs
from omnidraft.core.decode import GenerationResult
from omnidraft.data.models import wrap_model
from omnidraft.errors import OmniDraftError
from omnidraft.runner import Session, check_config


@dataclass
class TextOutput:
    text: str
    result: GenerationResult
    baseline: GenerationResult | None = None


class Decoder(Session):
    """A Session with text in, text out. With an adapting method (``omnidraft``) the drafter
    updates itself every ``method.adapt.interval`` calls, as the runner does on a stream."""

    def __init__(self, cfg, target=None, draft=None):
        super().__init__(cfg, target=target, draft=draft)
        self.n_calls = self.accepted = self.proposed = self.steps = self.new_tokens = 0
        self.last_update: dict = {}
        self.last_result: GenerationResult | None = None  # generate()'s, with its step records

    def generate_text(self, prompt: str, *, with_baseline: bool = False, seed: int = 0,
                      max_new_tokens: int | None = None, adapt: bool = True) -> TextOutput:
        ids = self.prompt_ids(prompt)
        self.check_context("api", len(ids))
        res = Session.generate(self, ids, seed=seed, max_new_tokens=max_new_tokens)
        base = Session.generate(self, ids, baseline=True, seed=seed, max_new_tokens=max_new_tokens) \
            if with_baseline else None
        self._count(res, adapt)
        return TextOutput(self.target.tokenizer.decode(res.tokens, skip_special_tokens=True), res, base)

    def generate(self, input_ids, max_new_tokens: int | None = None, *, seed: int = 0, adapt: bool = True,
                 baseline: bool = False, **kwargs: Any):
        """Token ids in, token ids out, as ``target.generate`` returns them: ``input_ids`` (a ``(1, n)``
        tensor or a list of ids, no template applied) followed by the new tokens, a ``(1, n + m)``
        LongTensor on the input's device. Greedy unless the decoder was built with a temperature;
        with greedy verification the output equals ``target.generate(input_ids, do_sample=False)``.
        Adapting methods learn from the call (``adapt=False``: serve frozen). ``baseline=True``
        decodes with the target alone (``ar``), for comparison.
        """
        for k, v in kwargs.items():
            if k == "do_sample" and v and not self.cfg.method.temperature:
                raise OmniDraftError("do_sample=True: build the decoder with a temperature "
                                     "(from_models(..., temperature=0.7)); its verify rule depends on it")
            if k == "attention_mask" and v is not None and not bool(torch.as_tensor(v).all()):
                raise OmniDraftError("attention_mask with padding: pass one unpadded sequence")
            if k not in ("do_sample", "attention_mask", "pad_token_id", "eos_token_id", "use_cache"):
                raise OmniDraftError(f"generate() does not take {k!r}; it takes input_ids, max_new_tokens, seed, adapt")
        device = input_ids.device if torch.is_tensor(input_ids) else torch.device("cpu")
        ids = torch.as_tensor(input_ids).tolist()
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise OmniDraftError(f"input_ids has a batch of {len(ids)}: speculative decoding here decodes one "
                                     "sequence at a time; loop over them")
            ids = ids[0]
        self.check_context("generate", len(ids))
        res = super().generate([int(t) for t in ids], baseline=baseline, seed=seed, max_new_tokens=max_new_tokens)
        self.last_result = res
        if not baseline:
            self._count(res, adapt)
        return torch.tensor([[*ids, *res.tokens]], dtype=torch.long, device=device)

    def _count(self, res: GenerationResult, adapt: bool) -> None:
        self.n_calls += 1
        self.accepted += res.accepted
        self.proposed += res.proposed
        self.steps += len(res.steps)
        self.new_tokens += res.n_new
        if adapt:  # the runner's schedule: drafter every adapt.interval calls, the acceptance head on its own
            self.last_update = self.after_prompt(self.n_calls - 1) or self.last_update

    def save_pretrained(self, path: str | Path) -> Path:
        """Export the adapted drafter: ``path`` loads with ``AutoModelForCausalLM.from_pretrained``
        (the served weights: a LoRA drafter's adapters merged for the active target) and its
        tokenizer with ``PreTrainedTokenizerFast.from_pretrained`` (``AutoTokenizer`` too where it
        reads tokenizer.json faithfully: :func:`tokenizer_round_trips`), and ``path/omnidraft`` holds what the weights do not: each target's
        n-gram cache, acceptance head and draft-length policy (no optimiser, no training buffer).

        Serve it with ``from_models(target, tok, AutoModelForCausalLM.from_pretrained(path), ...,
        overrides=["drafter.init_state=<path>/omnidraft", "drafter.init_ngram=true"])``, or from the
        command line: ``omnidraft drafter.source=local drafter.path=<path>
        drafter.init_state=<path>/omnidraft drafter.init_ngram=true``.
        """
        if self.draft_lm is None:
            raise OmniDraftError(f"method={self.cfg.method.name} has no drafter model to export")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.draft_lm.model.save_pretrained(path, safe_serialization=True)
        self.draft_lm.tokenizer.save_pretrained(path)
        faithful = tokenizer_round_trips(self.draft_lm.tokenizer, path)
        st = self.state(self.n_calls, [], {"kind": "export"})
        weights = re.compile(r"(^|\.)(param|opt|buffer)\.")  # weights (in the model dir), optimiser, examples
        tensors = {k: v for k, v in st.tensors.items() if not weights.search(k)}
        meta = {k: v for k, v in st.meta.items() if k != "learner"}
        meta.update(weights_external=True, lora=None, auto_tokenizer_faithful=faithful)
        for part in (meta.get(state_io.TARGETS) or {}).values():
            if isinstance(part, dict):
                part.pop("learner", None)
                part["lora"] = None
        state_io.save(path / "omnidraft", state_io.SavedState(meta, tensors, []))
        return path

    def stats(self) -> dict[str, float]:
        """Cumulative acceptance over the calls so far, n-gram cache and update statistics."""
        out = {"calls": self.n_calls, "accept/rate": self.accepted / self.proposed if self.proposed else 0.0,
               "accept/mean_len": self.new_tokens / self.steps if self.steps else 0.0, **self.drafter_stats()}
        if self.learner is not None:
            out["adapt/n_updates"] = self.learner.n_updates
            out["adapt/buffer"] = len(self.learner.buffer)
            out.update(self.last_update)
        if self.head_learner is not None:
            out["head/n_updates"] = self.head_learner.n_updates
            out.update(self.head_learner.calibration(reset=False))
        return out


def compose_config(*, target: str | None = None, drafter: str | None = None, method: str | None = None,
                   overrides: list[str] | None = None):
    """Compose the Hydra config the CLI would build (run_dir is unused outside runs)."""
    over = [f"{g}={v}" for g, v in (("target", target), ("drafter", drafter), ("method", method)) if v]
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=.", *over, *(overrides or [])])
    check_config(cfg)
    return cfg


def load(*, target: str | None = None, drafter: str | None = None, method: str | None = None,
         overrides: list[str] | None = None) -> Decoder:
    """Load models once and return a :class:`Decoder`."""
    return Decoder(compose_config(target=target, drafter=drafter, method=method, overrides=overrides))


_PROBE_TEXTS = (" hello\n  world", "def f(a, b):\n    return a + b\n\n", "Natalia sold 48 clips in April.",
                "  \t tabs  and   spaces ", "caf\u00e9 na\u00efve \u65e5\u672c \U0001f600")


def tokenizer_round_trips(tokenizer, path: Path) -> bool:
    """Whether ``AutoTokenizer.from_pretrained(path)`` encodes like ``tokenizer`` does. It may not:
    with a config.json beside it, AutoTokenizer can pick the model type's own tokenizer class,
    which rebuilds the pre-tokenizer (a Llama-2-vocabulary drafter saved with a Qwen2 config,
    transformers 5.x). ``PreTrainedTokenizerFast.from_pretrained(path)`` reads tokenizer.json as
    written; the export warns and records ``auto_tokenizer_faithful`` when only that one is."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(path)
    same = all(auto.encode(t) == tokenizer.encode(t) for t in _PROBE_TEXTS)
    if not same:
        warnings.warn(f"AutoTokenizer.from_pretrained({str(path)!r}) encodes differently from the drafter's tokenizer "
                      "in this transformers version; load the exported tokenizer with "
                      "PreTrainedTokenizerFast.from_pretrained", stacklevel=3)
    return same


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "model"


def from_models(target_model, target_tokenizer, drafter_model=None, drafter_tokenizer=None, *,
                method: str = "omnidraft", temperature: float | None = None, max_new_tokens: int | None = None,
                overrides: list[str] | None = None) -> Decoder:
    """A :class:`Decoder` over models the caller built (``AutoModelForCausalLM`` /
    ``AutoTokenizer`` objects), the way ``target.generate(..., assistant_model=drafter,
    tokenizer=..., assistant_tokenizer=...)`` takes them. The tokenizers may differ (the direct
    map and the n-gram cache bridge them). Nothing is copied: an adapting method (``omnidraft``,
    ``osd``) trains ``drafter_model``'s weights in place (pass a copy to keep the original).

    Args:
        target_model, target_tokenizer: the model whose output is kept.
        drafter_model, drafter_tokenizer: the drafter (not for ``ar``, ``pld``).
        method: a ``conf/method`` name.
        temperature: sampling temperature (default the method's, 0 = greedy).
        max_new_tokens: the default length of ``generate`` (``decode.max_new_tokens``).
        overrides: any further config overrides (``method.k=8``, ``method.adapt.interval=4``,
            ``drafter.init_state=DIR``...).
    """
    tgt = wrap_model(target_model, target_tokenizer)
    over = ["target=given", f"target.name={_slug(tgt.name)}", f"target.dtype={str(tgt.dtype).removeprefix('torch.')}",
            f"target.device={tgt.device}"]
    draft = None
    if drafter_model is not None:
        if drafter_tokenizer is None:
            raise OmniDraftError("drafter_model without drafter_tokenizer: pass both (the drafter's own tokenizer)")
        draft = wrap_model(drafter_model, drafter_tokenizer)
        over += ["drafter=given", f"drafter.name={_slug(draft.name)}",
                 f"drafter.dtype={str(draft.dtype).removeprefix('torch.')}", f"drafter.device={draft.device}"]
    if temperature is not None:
        over.append(f"method.temperature={float(temperature)}")
    if max_new_tokens is not None:
        over.append(f"decode.max_new_tokens={int(max_new_tokens)}")
    cfg = compose_config(method=method, overrides=over + list(overrides or []))
    if cfg.method.drafts_with == "model" and draft is None:
        raise OmniDraftError(f"method={method} drafts with a model: pass drafter_model and drafter_tokenizer")
    if cfg.drafter is not None and cfg.drafter.init_state:
        init = state_io.read_meta(Path(cfg.drafter.init_state) / state_io.META) \
            if (Path(cfg.drafter.init_state) / state_io.META).is_file() else {}
        if init.get("weights_external") and draft is None:
            warnings.warn("drafter.init_state is an export without weights: pass the exported model", stacklevel=2)
    return Decoder(cfg, target=tgt, draft=draft)
