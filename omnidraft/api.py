"""Python API for notebooks: build a decoder from config names and call it on prompts.

    from omnidraft.api import load
    dec = load(target="qwen25_coder_05b", drafter="smollm2_135m", method="omnidraft")
    for q in questions:                      # adapts online: an update every method.adapt.interval calls
        out = dec.generate_text(q)
    out.text, out.result.accepted, out.result.proposed, dec.stats()
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra import compose, initialize_config_dir

from omnidraft.config import CONF_DIR, register_configs
from omnidraft.core.decode import GenerationResult
from omnidraft.runner import Session, check_config


@dataclass
class TextOutput:
    text: str
    result: GenerationResult
    baseline: GenerationResult | None = None


class Decoder(Session):
    """A Session with text in, text out. With an adapting method (``omnidraft``) the drafter
    updates itself every ``method.adapt.interval`` calls, as the runner does on a stream."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.n_calls = self.accepted = self.proposed = self.steps = self.new_tokens = 0
        self.last_update: dict = {}

    def generate_text(self, prompt: str, *, with_baseline: bool = False, seed: int = 0,
                      max_new_tokens: int | None = None, adapt: bool = True) -> TextOutput:
        ids = self.prompt_ids(prompt)
        self.check_context("api", len(ids))
        res = self.generate(ids, seed=seed, max_new_tokens=max_new_tokens)
        base = self.generate(ids, baseline=True, seed=seed, max_new_tokens=max_new_tokens) if with_baseline else None
        self.n_calls += 1
        self.accepted += res.accepted
        self.proposed += res.proposed
        self.steps += len(res.steps)
        self.new_tokens += res.n_new
        if adapt:  # the runner's schedule: drafter every adapt.interval calls, the acceptance head on its own
            self.last_update = self.after_prompt(self.n_calls - 1) or self.last_update
        return TextOutput(self.target.tokenizer.decode(res.tokens, skip_special_tokens=True), res, base)

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
