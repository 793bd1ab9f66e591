"""``run(cfg) -> dict``: stream a task through the chosen method, measure, log, summarise.

The only module besides the CLI that reads the Hydra config. Models load once; every prompt is
decoded by the method and (when ``measure_baseline``) by ``ar`` in the same process, alternating
which goes first so machine drift hits both equally.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from omnidraft import provenance
from omnidraft import state as state_io
from omnidraft.core.decode import generate
from omnidraft.data.models import LoadedModel, load_model, resolve_dtype
from omnidraft.data.quality import score as quality_score
from omnidraft.data.quality import summarise_quality
from omnidraft.data.tasks import format_prompt, load_stream, render
from omnidraft.drafting.direct_map import build_bridge, tokenizer_hash
from omnidraft.errors import OmniDraftError
from omnidraft.instantiate import call_with, check_targets
from omnidraft.learn.online import OnlineLearner, merge_lora_state
from omnidraft.loggers import JSONLLogger, MultiLogger
from omnidraft.tables import drafter_row, prompt_row, summarise

# Arguments the runner can supply when it builds each _target_ node (each gets those it accepts).
RUNTIME_ARGS = {
    "method.drafter": {"model", "tokenizer", "bridge", "target_vocab_size", "target_eos", "learner", "verify"},
}
LOGGER_RUNTIME_ARGS = {"run_dir", "run_config"}


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def portable_config(cfg: DictConfig) -> dict:
    """The resolved config with machine-specific paths made portable for the record: paths under
    the working directory become relative, the home directory becomes '~'."""
    c = OmegaConf.to_container(cfg, resolve=True)
    home, cwd = str(Path.home()), os.getcwd()

    def fix(p):
        if not isinstance(p, str) or not os.path.isabs(p):
            return p
        if p == cwd or p.startswith(cwd + os.sep):
            return os.path.relpath(p, cwd)
        return "~" + p[len(home):] if p.startswith(home + os.sep) else p

    c["run_dir"] = fix(c.get("run_dir"))
    c["paths"]["cache_dir"] = fix(c["paths"]["cache_dir"])
    return c


def _choices() -> dict[str, str]:
    """Config group choices of this run (target, drafter, method, ablation, ...), when run by Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return {k: v for k, v in HydraConfig.get().runtime.choices.items()
                if not k.startswith("hydra") and v is not None}
    except ValueError:
        return {}


def _overrides(cfg: DictConfig) -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return list(cfg.get("overrides") or [])


def resolve_dtypes(cfg: DictConfig) -> None:
    """Replace ``dtype: auto`` of the target and drafter by what it means on this machine
    (bfloat16 where native, else float32; :func:`omnidraft.data.models.resolve_dtype`), so the saved
    config.yaml and the resume fingerprint name the dtype that actually ran: a stream started in
    bf16 is not silently resumed in fp32 on another machine."""
    for role in ("target", "drafter"):
        node = cfg.get(role)
        if node is not None and node.get("dtype") == "auto":
            node.dtype = resolve_dtype("auto", node.get("device", "cpu"))


def check_config(cfg: DictConfig) -> None:
    """Everything that can be checked before a model loads."""
    runtime = dict(RUNTIME_ARGS)
    for name in (cfg.logger or {}):
        runtime[f"logger.{name}"] = LOGGER_RUNTIME_ARGS
    check_targets(cfg, runtime)
    m = cfg.method
    if m.engine not in ("omnidraft", "hf_assisted"):
        raise OmniDraftError(f"method.engine={m.engine!r}: use omnidraft (this package's loop) or hf_assisted "
                             "(transformers' assisted generation)")
    if m.engine == "hf_assisted":
        if m.temperature > 0 or m.adapt.enabled or m.draft_length.policy != "fixed":
            raise OmniDraftError(f"method {m.name!r} runs transformers' assisted generation: greedy, frozen, "
                                 "its own draft-length schedule (set method.hf.*), no adapt or draft_length")
    elif m.name != "ar" and m.drafter is None:
        raise OmniDraftError(f"method {m.name!r} has no drafter config; set method.drafter or use method=ar")
    if uses_draft_model(m) and cfg.drafter is None:
        raise OmniDraftError(f"method {m.name!r} needs a drafter model; pass drafter=<name>")
    if m.adapt.enabled:
        if not drafter_accepts(m, "learner"):
            raise OmniDraftError(f"method.adapt.enabled=true needs a drafter that records training data "
                                 f"(omnidraft.drafting.model_drafters.NgramDrafter), not {m.drafter['_target_']}")
    a = m.adapt
    from omnidraft.learn.online import DTYPES, LOSSES, POSITIONS

    if a.loss not in LOSSES:
        raise OmniDraftError(f"method.adapt.loss={a.loss!r}: use one of {', '.join(LOSSES)}")
    if a.positions not in POSITIONS:
        raise OmniDraftError(f"method.adapt.positions={a.positions!r}: use drafted or rejected (OSD)")
    if a.train_dtype not in DTYPES:
        raise OmniDraftError(f"method.adapt.train_dtype={a.train_dtype!r}: use one of {', '.join(DTYPES)}")
    if not 0 <= a.jsd_beta <= 1:
        raise OmniDraftError(f"method.adapt.jsd_beta={a.jsd_beta} must be in [0, 1]")
    hf = m.hf
    if hf.num_assistant_tokens is not None and hf.num_assistant_tokens < 1:
        raise OmniDraftError(f"method.hf.num_assistant_tokens={hf.num_assistant_tokens} must be >= 1 (or null)")
    if hf.num_assistant_tokens_schedule not in (None, "constant", "heuristic", "heuristic_transient"):
        raise OmniDraftError(f"method.hf.num_assistant_tokens_schedule={hf.num_assistant_tokens_schedule!r}: "
                             "use constant, heuristic or heuristic_transient (or null)")
    if cfg.drafter is not None and cfg.drafter.init_state:
        check_disjoint(cfg)
    if m.verify not in ("lossless", "paper"):
        raise OmniDraftError(f"method.verify={m.verify!r}: use lossless (greedy, exact) or paper (OmniDraft's q' rule)")
    if m.name != "ar" and m.temperature > 0 and m.verify == "lossless":
        if drafter_accepts(m, "verify"):
            raise OmniDraftError("sampling with the n-gram cache has no lossless rule; set method.verify=paper "
                                 "(OmniDraft's approximate q', not lossless) or method.temperature=0")
    if m.name == "distillspec" and (cfg.drafter is None or not cfg.drafter.init_state):
        raise OmniDraftError("method=distillspec serves an offline-distilled drafter: run `omnidraft distill` "
                             "first, then pass drafter.init_state=<its run_dir>/state")
    if cfg.resume and cfg.drafter is not None and cfg.drafter.init_state:
        raise OmniDraftError("resume=true continues this run's own state; drop drafter.init_state")
    dr = m.get("drafter") or {}
    if "eviction" in dr or "capacity" in dr:  # the cache's own rule, checked before any model loads
        from omnidraft.drafting.ngram_cache import NgramCache

        try:
            NgramCache(capacity=dr.get("capacity"), eviction=dr.get("eviction", "lru"))
        except ValueError as e:
            raise OmniDraftError(f"method.drafter: {e} (capacity null = unbounded)") from None
    dl = m.draft_length
    if dl.policy not in ("fixed", "heuristic", "head"):
        raise OmniDraftError(f"method.draft_length.policy={dl.policy!r}: use fixed, heuristic or head")
    if dl.head_mode not in ("joint", "interleaved"):
        raise OmniDraftError(f"method.draft_length.head_mode={dl.head_mode!r}: use joint or interleaved")
    if dl.head_label not in ("verify", "t1"):
        raise OmniDraftError(f"method.draft_length.head_label={dl.head_label!r}: use verify or t1")
    if not 1 <= dl.k_min <= dl.k_max:
        raise OmniDraftError(f"method.draft_length: need 1 <= k_min <= k_max, got {dl.k_min}..{dl.k_max}")
    if dl.gamma is not None and not 0 < dl.gamma < 1:
        raise OmniDraftError(f"method.draft_length.gamma={dl.gamma} must be in (0, 1)")
    if dl.gamma_infer is not None and not 0 < dl.gamma_infer < 1:
        raise OmniDraftError(f"method.draft_length.gamma_infer={dl.gamma_infer} must be in (0, 1)")
    if dl.gamma_infer is not None and (dl.head_learn or dl.policy != "head"):
        raise OmniDraftError("method.draft_length.gamma_infer is the frozen head's threshold: add "
                             "method.draft_length.policy=head method.draft_length.head_learn=false, or use gamma")
    if dl.policy != "fixed" and m.name == "ar":
        raise OmniDraftError("method=ar drafts nothing: drop method.draft_length.policy")
    if m.k < 1:
        raise OmniDraftError(f"method.k={m.k} must be >= 1")
    if cfg.decode.max_new_tokens < 1:
        raise OmniDraftError(f"decode.max_new_tokens={cfg.decode.max_new_tokens} must be >= 1")


def check_disjoint(cfg: DictConfig) -> None:
    """Compare this run's prompts with those drafter.init_state was trained on: refuse an overlap
    with a DistillSpec training split (an offline training set), warn on an overlap with the
    stream an online state adapted on (re-serving it is legitimate; a benchmark on it is not)."""
    meta_path = Path(cfg.drafter.init_state) / "meta.json"
    if not meta_path.exists():
        return  # load() reports a missing state with its own message
    meta = json.loads(meta_path.read_text())
    split = meta.get("train_split")
    t = cfg.task
    if not split or split["task"] != t.name:
        return
    offline = meta.get("kind") == "distillspec"
    what = "distilled" if offline else "adapted online"
    same_order = split.get("shuffle") == bool(t.shuffle) and (not t.shuffle or split.get("seed") == int(cfg.seed))
    if not same_order:  # offsets only compare within one permutation
        if offline:
            raise OmniDraftError(f"drafter.init_state was distilled on {t.name} with another task.shuffle/seed "
                                 "than this run; use the same so the prompts can be checked to be disjoint")
        return
    a0 = int(split["offset"])
    a1 = a0 + int(split.get("n", meta.get("next_index", 0)))  # online states: the prompts done so far
    b0 = int(t.offset)
    b1 = b0 + int(t.limit) if t.limit is not None else float("inf")
    if a0 < b1 and b0 < a1:
        msg = (f"drafter.init_state was {what} on {t.name} prompts {a0}..{a1 - 1}, which overlap "
               f"this run's prompts {b0}..{'end' if b1 == float('inf') else int(b1) - 1}")
        if offline:
            raise OmniDraftError(f"{msg}; move task.offset/limit or distill on another split")
        import warnings

        warnings.warn(f"{msg}: its acceptance there is not out-of-sample (move task.offset for a fair "
                      "comparison)", stacklevel=2)


def task_templates(t) -> dict[str, str]:
    """Prompt templates of a task config node, by task name (component tasks too)."""
    return {**({t.name: t.template} if t.template else {}), **dict(t.templates or {})}


def start_run(cfg: DictConfig, overrides: list[str]) -> tuple[Path, dict[str, Any]]:
    """Create run_dir, write its portable config.yaml, set torch threads; returns (run_dir, provenance)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(portable_config(cfg)))
    prov = provenance.collect(int(cfg.seed), overrides)
    # also at the start: a run killed before its summary (SIGKILL, machine gone) keeps its provenance
    (run_dir / "provenance.json").write_text(json.dumps(prov, indent=2, default=str))
    return run_dir, prov


def uses_draft_model(m) -> bool:
    """Whether a method needs a drafter LM (model-free drafters such as prompt lookup do not)."""
    if m.name == "ar":
        return False
    if m.engine == "hf_assisted":
        return bool(m.hf.assistant)
    return drafter_accepts(m, "model")


def drafter_accepts(m, arg: str) -> bool:
    """Whether the method's drafter class takes ``arg`` (model, learner, verify, ...)."""
    import inspect

    from omnidraft.instantiate import import_target

    return arg in inspect.signature(import_target(m.drafter["_target_"])).parameters


def _load_init_weights(model, init) -> None:
    """Serve a saved drafter state frozen: its weights, or a LoRA state merged into the weights."""
    if init.meta.get("lora"):
        merge_lora_state(model, init.tensors, tuple(init.meta["lora"]))
    else:
        state_io.load_weights(model, init.tensors)


class Session:
    """Loaded models + drafter for one (target, drafter, method): what notebooks use."""

    def __init__(self, cfg: DictConfig, target: LoadedModel | None = None, draft: LoadedModel | None = None):
        """``target`` / ``draft``: already loaded models to share (the bench loads the target once,
        and one frozen base drafter for every method that neither trains nor loads a state)."""
        self.cfg = cfg
        cache = Path(cfg.paths.cache_dir)
        self.target: LoadedModel = target if target is not None else load_model(_plain(cfg.target), cache)
        self.draft_lm: LoadedModel | None = None
        self.drafter = None
        self.bridge = None
        self.learner = None
        self.lora = None
        self.head_learner = None
        self.hf = None
        m = cfg.method
        if m.engine == "hf_assisted":
            from omnidraft.drafting.hf_assisted import HFAssisted

            hf = _plain(m.hf)
            if hf.pop("assistant"):
                self.draft_lm = draft if draft is not None else load_model(_plain(cfg.drafter), cache)
                if cfg.drafter.init_state:
                    _load_init_weights(self.draft_lm.model, state_io.load(cfg.drafter.init_state))
            dm = self.draft_lm
            self.hf = HFAssisted(self.target.model, dm.model if dm else None, self.target.tokenizer,
                                 dm.tokenizer if dm else None, **hf)
        elif m.name != "ar" and not uses_draft_model(m):  # model-free drafting (prompt lookup)
            v_t = self.target.model.get_output_embeddings().weight.shape[0]
            self.drafter = call_with(instantiate(m.drafter), target_vocab_size=v_t, target_eos=self.target.eos_ids,
                                     tokenizer=self.target.tokenizer)
        elif m.name != "ar":
            self.draft_lm = draft if draft is not None else load_model(_plain(cfg.drafter), cache)
            if cfg.method.name == "sd" and tokenizer_hash(self.draft_lm.tokenizer) != tokenizer_hash(self.target.tokenizer):
                raise OmniDraftError(
                    f"method=sd needs a drafter that shares the target's tokenizer; {cfg.drafter.name} "
                    f"and {cfg.target.name} differ: use method=spd_dm")
            self.bridge = build_bridge(self.draft_lm.tokenizer, self.target.tokenizer, cache)
            factory = instantiate(cfg.method.drafter)
            v_t = self.target.model.get_output_embeddings().weight.shape[0]
            a = cfg.method.adapt
            init = state_io.load(cfg.drafter.init_state) if cfg.drafter.init_state else None
            lora = (a.lora_rank, a.lora_alpha, list(a.lora_target_modules)) if a.enabled and a.lora_rank else None
            if init is not None and init.meta.get("lora") and lora is None:
                lora = tuple(init.meta["lora"])  # serve an adapted LoRA drafter with its adapters
            self.lora = list(lora) if lora else None
            # LoRA adapters live on the learner's training copy; the served drafter stays plain
            # and gets the merged weights (no adapter matmuls while drafting).
            self.learner = OnlineLearner(
                self.draft_lm.model, self.bridge, lam=a.lam, loss=a.loss, lr=a.lr,
                weight_decay=a.weight_decay, batch_size=a.batch_size,
                steps_per_update=a.steps_per_update, seed=int(cfg.seed),
                context_grad=a.context_grad, train_dtype=a.train_dtype, positions=a.positions,
                jsd_beta=a.jsd_beta, lora=lora) if a.enabled else None
            if init is not None:
                if self.learner is not None:
                    self.learner.load_state_dict(init.tensors, init.meta.get("learner") or {}, weights_only=True)
                else:
                    _load_init_weights(self.draft_lm.model, init)
            self.drafter = call_with(factory, model=self.draft_lm.model, tokenizer=self.draft_lm.tokenizer,
                                     bridge=self.bridge, target_vocab_size=v_t,
                                     target_eos=self.target.eos_ids, learner=self.learner,
                                     verify=cfg.method.verify)
            if init is not None and cfg.drafter.init_ngram and "drafter" in init.meta \
                    and hasattr(self.drafter, "load_state_dict"):
                self.drafter.load_state_dict(init.meta["drafter"])  # the adapted stream's n-gram cache
            self._build_length_policy(init)

    def prompt_ids(self, text: str | list[dict[str, str]]) -> list[int]:
        """Target token ids for one user message or a conversation (chat template when the
        target has one and ``target.chat_template``)."""
        c = self.cfg
        return format_prompt(self.target.tokenizer, text, system=c.task.system_prompt,
                             use_chat_template=c.target.chat_template)

    def templates(self) -> dict[str, str]:
        return task_templates(self.cfg.task)

    def generate(self, prompt_ids: list[int], *, baseline: bool = False, seed: int = 0,
                 max_new_tokens: int | None = None):
        m = self.cfg.method
        g = torch.Generator().manual_seed(seed)
        n_new = max_new_tokens or self.cfg.decode.max_new_tokens
        if self.hf is not None and not baseline:
            return self.hf.generate(prompt_ids, max_new_tokens=n_new, eos_ids=self.target.eos_ids,
                                    temperature=m.temperature, generator=g)
        return generate(self.target.model, prompt_ids, drafter=None if baseline else self.drafter,
                        k=self.draft_k(), max_new_tokens=n_new,
                        eos_ids=self.target.eos_ids, temperature=m.temperature, generator=g)

    def _build_length_policy(self, init: state_io.SavedState | None = None) -> None:
        from omnidraft.learn.acceptance_head import AcceptanceHead, HeadLearner
        from omnidraft.learn.draft_length import HeadPolicy, HeuristicK

        dl, m = self.cfg.method.draft_length, self.cfg.method
        if dl.policy == "fixed":
            return
        setter = getattr(self.drafter, "set_length_policy", None)
        if setter is None:
            raise OmniDraftError(f"method.draft_length.policy={dl.policy} needs a model drafter")
        if dl.policy == "heuristic":
            setter(HeuristicK(k_start=m.k, k_min=dl.k_min, k_max=dl.k_max))
            return
        gamma = self._gamma(self.cfg.task.name)
        head = AcceptanceHead(int(self.draft_lm.model.config.hidden_size), dl.head_blocks).to(self.draft_lm.model.device)
        head_init = {k[len("head."):]: v for k, v in (init.tensors if init is not None else {}).items()
                     if k.startswith("head.")}
        if head_init:  # the head an earlier stream trained serves this one
            head.load_state_dict(head_init)
        elif not dl.head_learn:
            raise OmniDraftError("method.draft_length.head_learn=false serves a trained head: pass "
                                 "drafter.init_state=<a run with policy=head>/state")
        self.head_learner = HeadLearner(head, mode=dl.head_mode, lr=dl.head_lr, mismatch_weight=dl.mismatch_weight,
                                        batch_size=dl.head_batch_size, replay=dl.replay, steps=dl.head_steps,
                                        every=dl.head_every, seed=int(self.cfg.seed), learn=dl.head_learn,
                                        label=dl.head_label)
        if dl.head_mode == "joint" and dl.head_learn and self.learner is not None:
            self.learner.attach_head(self.head_learner)  # one update on L_distill + L_head
        setter(HeadPolicy(head, gamma=gamma, k_min=dl.k_min, k_max=dl.k_max), self.head_learner)

    def _gamma(self, task: str) -> float:
        """The head's stop threshold: gamma_infer (a frozen head), gamma, or the task's preset."""
        from omnidraft.learn.draft_length import GAMMA_PRESETS

        dl = self.cfg.method.draft_length
        if not dl.head_learn and dl.gamma_infer is not None:
            return float(dl.gamma_infer)
        return float(dl.gamma) if dl.gamma is not None else GAMMA_PRESETS.get(task, 0.7)

    def set_task(self, task: str) -> None:
        """The prompt about to be decoded comes from ``task`` (mixed streams, the bench): a head
        whose gamma is the task preset takes that task's preset."""
        pol = getattr(self.drafter, "policy", None)
        if self.head_learner is not None and hasattr(pol, "gamma"):
            pol.gamma = self._gamma(task)

    def draft_k(self) -> int:
        """The per-step draft budget handed to the decode loop."""
        dl = self.cfg.method.draft_length
        return int(dl.k_max) if dl.policy in ("heuristic", "head") else int(self.cfg.method.k)

    def head_update_due(self, i: int) -> bool:
        if self.head_learner is None or not self.head_learner.learn or self.head_learner.in_learner:
            return False  # a jointly trained head updates inside the drafter's update
        dl, a = self.cfg.method.draft_length, self.cfg.method.adapt
        every = int(dl.head_every) if dl.head_mode == "interleaved" else int(a.interval)
        return (i + 1) % every == 0

    def after_prompt(self, i: int, progress: bool = False) -> dict[str, float]:
        """Online updates due after the stream's prompt ``i`` (0-based): the drafter every
        ``adapt.interval`` prompts, the acceptance head on its own schedule. Returns their stats."""
        row: dict[str, float] = {}
        if self.learner is not None and (i + 1) % int(self.cfg.method.adapt.interval) == 0:
            t_up = time.perf_counter()
            row.update(self.learner.update(progress=progress))
            row["adapt/update_s"] = time.perf_counter() - t_up
        if self.head_update_due(i):
            t_up = time.perf_counter()
            row.update(self.head_learner.update())
            row["adapt/update_s"] = row.get("adapt/update_s", 0.0) + time.perf_counter() - t_up
        return row

    def paused(self):
        """Warm-up context: the drafter neither learns nor touches the stream's cache (nor
        transformers' heuristic draft length, for the uag methods)."""
        p = getattr(self.hf if self.hf is not None else self.drafter, "paused", None)
        return p() if callable(p) else contextlib.nullcontext()

    def state(self, next_index: int, rows: list[dict[str, Any]], meta: dict[str, Any]) -> state_io.SavedState:
        """The online state after ``next_index`` prompts."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {**meta, "next_index": next_index, "lora": self.lora if self.draft_lm is not None else None}
        if self.learner is not None:
            tensors, meta["learner"] = self.learner.state_dict()
        if self.head_learner is not None:
            head_tensors, meta["head"] = self.head_learner.state_dict()
            tensors = {**tensors, **head_tensors}
        if self.drafter is not None and hasattr(self.drafter, "policy"):
            meta["policy"] = self.drafter.policy.state_dict()
        sd = getattr(self.drafter, "state_dict", None)
        if callable(sd):
            meta["drafter"] = sd()
        if self.hf is not None:
            meta["hf"] = self.hf.state_dict()  # transformers' heuristic draft length (uag_k5)
        return state_io.SavedState(meta, tensors, rows)

    def restore(self, st: state_io.SavedState) -> None:
        if self.learner is not None:
            self.learner.load_state_dict(st.tensors, st.meta["learner"])
        if "drafter" in st.meta:
            self.drafter.load_state_dict(st.meta["drafter"])
        if self.head_learner is not None:
            self.head_learner.load_state_dict(st.tensors, st.meta["head"])
        if "policy" in st.meta:
            self.drafter.policy.load_state_dict(st.meta["policy"])
        if self.hf is not None and "hf" in st.meta:
            self.hf.load_state_dict(st.meta["hf"])

    def drafter_stats(self) -> dict[str, float]:
        stats = getattr(self.drafter, "stats", None)
        return stats() if callable(stats) else {}

    def check_context(self, rid: str, n_prompt: int) -> None:
        need = n_prompt + self.cfg.decode.max_new_tokens
        for role, lm in (("target", self.target), ("drafter", self.draft_lm)):
            if lm is not None and need > lm.max_context:
                raise OmniDraftError(
                    f"prompt {rid!r} has {n_prompt} tokens; with decode.max_new_tokens="
                    f"{self.cfg.decode.max_new_tokens} it exceeds the {role} {lm.name}'s context of "
                    f"{lm.max_context}; lower decode.max_new_tokens or drop the prompt (task.offset/limit)")
            window = sliding_window(lm.model.config) if lm is not None else None
            if window is not None and need > window:
                raise OmniDraftError(
                    f"prompt {rid!r} needs {need} positions but the {role} {lm.name} uses sliding-window "
                    f"attention over {window}; KV rollback past the window is not supported: lower "
                    "decode.max_new_tokens or use shorter prompts")


def sliding_window(config) -> int | None:
    """The attention window of models with sliding-window layers (e.g. Gemma-3), else None."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return int(config.sliding_window)
    return None


# Config keys that may change when a stream is resumed (everything else must match the state).
_RESUME_FREE = {"resume", "progress", "threads", "run_dir", "logger", "paths", "overrides",
                "checkpoint_every", "state_dir"}


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    c = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in c.items() if k not in _RESUME_FREE}


def _diff(a: dict, b: dict, prefix: str = "") -> str | None:
    """First difference between the saved fingerprint ``a`` and the current ``b``; keys that
    newer code added to the config (absent from ``a``) are not differences."""
    for k in sorted(a):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            d = _diff(x, y, f"{prefix}{k}.")
            if d:
                return d
        elif x != y:
            return f"{prefix}{k}: saved {x!r}, now {y!r}"
    return None


def _by_task(rows: list[dict[str, Any]], greedy: bool, window: int) -> dict[str, Any]:
    """Per-task acceptance and quality for streams that mix tasks."""
    tasks = sorted({r.get("task") for r in rows if r.get("task")})
    if len(tasks) < 2:
        return {}
    out = {}
    for name in tasks:
        rs = [r for r in rows if r.get("task") == name]
        s = summarise(rs, greedy, window)
        out[name] = {"n_prompts": len(rs), "accept/rate": s.get("accept/rate"),
                     "accept/mean_len": s.get("accept/mean_len"), **summarise_quality(rs)}
    return {"by_task": out}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run one experiment; returns the summary (also written to ``run_dir/summary.json``).

    With ``checkpoint_every`` the online state (weights, optimiser, n-gram cache, rows, stream
    position) is saved atomically every N prompts and at the end; ``resume=true`` continues from it.
    """
    check_config(cfg)
    resolve_dtypes(cfg)
    state_dir = Path(cfg.state_dir) if cfg.state_dir else Path(cfg.run_dir) / "state"
    saved = None
    if cfg.resume:
        saved = state_io.load(state_dir)
        d = _diff(saved.meta["fingerprint"], fingerprint(cfg))
        if d:
            raise OmniDraftError(f"cannot resume from {state_dir}: the config differs ({d}); "
                                 "resume with the run's original overrides, or start a new run_dir")
    run_dir, prov = start_run(cfg, _overrides(cfg))

    t_load = time.perf_counter()
    sess = Session(cfg)
    records = load_stream(_plain(cfg.task), Path(cfg.paths.cache_dir), seed=int(cfg.seed))
    load_s = time.perf_counter() - t_load

    rows: list[dict[str, Any]] = []
    start = 0
    segments = [provenance.segment(prov, 0)]
    if saved is not None:
        sess.restore(saved)
        rows, start = list(saved.rows), int(saved.meta["next_index"])
        segments = saved.meta.get("segments", []) + [provenance.segment(prov, start)]
        with open(run_dir / "metrics.jsonl", "w", encoding="utf-8") as f:  # drop rows past the checkpoint
            for n, r in enumerate(rows):
                f.write(json.dumps({"step": n, **r}, default=str) + "\n")
    elif (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()  # a fresh run in an old directory starts a fresh log
    prov["segments"] = segments

    sinks = [JSONLLogger(run_dir / "metrics.jsonl")]
    for name, node in (cfg.logger or {}).items():
        make = instantiate(node, _partial_=True)  # runtime args passed as plain objects, not configs
        sinks.append(call_with(make, run_dir=str(run_dir), run_config=OmegaConf.to_container(cfg, resolve=True)))
    log = MultiLogger(sinks)

    greedy = cfg.method.temperature <= 0
    measure = cfg.method.name != "ar" and cfg.measure_baseline
    every = max(1, int(cfg.baseline_every))
    ckpt = int(cfg.checkpoint_every)
    t = cfg.task
    meta = {"fingerprint": fingerprint(cfg), "segments": segments,
            # the prompts this state adapted on (their number is next_index), for runner.check_disjoint
            "train_split": {"task": t.name, "offset": int(t.offset), "shuffle": bool(t.shuffle),
                            "seed": int(cfg.seed)},
            "tokenizers": {"target": tokenizer_hash(sess.target.tokenizer),
                           "drafter": tokenizer_hash(sess.draft_lm.tokenizer) if sess.draft_lm else None}}
    summary: dict[str, Any] = {}
    status = "ok"
    try:
        templates = sess.templates()
        first = []
        for r in records:
            ids = sess.prompt_ids(render(r, 0, templates))
            sess.check_context(r.id, len(ids))
            first.append(ids)
        with sess.paused():
            for ids in first[: int(cfg.warmup_prompts)]:  # warm-up, not logged, learns nothing
                sess.generate(ids, max_new_tokens=16)
                if measure:
                    sess.generate(ids, baseline=True, max_new_tokens=16)
        bar = tqdm(total=len(records), initial=start, desc=f"{cfg.method.name} {t.name}",
                   unit="prompt", disable=not cfg.progress, dynamic_ncols=True)
        for i in range(start, len(records)):
            r = records[i]
            with_ar = measure and i % every == 0
            history: list[dict[str, str]] = []
            for turn in range(len(r.turns)):
                history.append({"role": "user", "content": render(r, turn, templates)})
                ids = first[i] if turn == 0 else sess.prompt_ids(history)
                if turn:
                    sess.check_context(f"{r.id} turn {turn + 1}", len(ids))
                seed = int(cfg.seed) * 1_000_003 + i + 100_003 * turn
                ar = None
                ar_first = (i // every) % 2 == 1  # alternates over the measured prompts, whatever `every`
                if with_ar and ar_first:
                    ar = sess.generate(ids, baseline=True, seed=seed)
                sess.set_task(r.metadata.get("task", t.name))
                before = sess.drafter_stats()
                sd = sess.generate(ids, seed=seed)
                if with_ar and not ar_first:
                    ar = sess.generate(ids, baseline=True, seed=seed)
                answer = sess.target.tokenizer.decode(sd.tokens, skip_special_tokens=True)
                row = {"prompt/id": r.id, "prompt/index": i, "prompt/turn": turn,
                       "task": r.metadata.get("task", t.name), "prompt/tokens": len(ids), **prompt_row(sd, ar),
                       **drafter_row(before, sess.drafter_stats(), len(sd.steps)),
                       **quality_score(r, turn, answer, sd.n_new, execute_code=bool(t.execute_code),
                                       timeout=float(t.exec_timeout_s), memory_mb=int(t.exec_memory_mb))}
                row["text/output"] = sess.target.tokenizer.decode(sd.tokens)
                history.append({"role": "assistant", "content": answer})
                last_turn = turn == len(r.turns) - 1
                if sess.head_learner is not None:
                    row.update(sess.head_learner.calibration())
                if last_turn:
                    row.update(sess.after_prompt(i, progress=bool(cfg.progress)))
                rows.append(row)
                log.log(row, step=len(rows) - 1)
            if (ckpt > 0 and (i + 1) % ckpt == 0) or i + 1 == len(records):
                state_io.save(state_dir, sess.state(i + 1, rows, meta))
            bar.update(1)
            summary = summarise(rows, greedy, int(cfg.metrics_window))
            post = {"acc": f"{summary['accept/rate']:.2f}", "len": f"{summary['accept/mean_len']:.2f}"}
            if "speed/speedup" in summary:
                post["speedup"] = f"{summary['speed/speedup']:.2f}x"
            bar.set_postfix(post)
        bar.close()
    except BaseException as e:  # keep what was computed, then re-raise
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        summary = summarise(rows, greedy, int(cfg.metrics_window))
        summary.update(summarise_quality(rows))
        summary.update(_by_task(rows, greedy, int(cfg.metrics_window)))
        summary.update({
            "status": status,
            "n_records": len({r["prompt/index"] for r in rows}),
            "method": cfg.method.name, "target": cfg.target.name,
            "drafter": sess.draft_lm.name if sess.draft_lm is not None else None,
            "task": cfg.task.name, "k": int(cfg.method.k), "temperature": float(cfg.method.temperature),
            "verify": cfg.method.verify,
            "max_new_tokens": int(cfg.decode.max_new_tokens),
            "baseline_every": every if measure else None,
            "time/load_s": load_s,
            "resumed_at": start if saved is not None else None,
            "choices": _choices(),
        })
        if sess.bridge is not None:
            summary.update(sess.bridge.stats())
        summary["provenance"] = prov
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        os.replace(tmp, run_dir / "summary.json")
        log.log_summary(summary)
        log.close()
    return summary
