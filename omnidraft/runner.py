"""``run(cfg) -> dict``: stream a task through the chosen method, measure, log, summarise.

The only module besides the CLI that reads the Hydra config. Models load once; every prompt is
decoded by the method and (when ``measure_baseline``) by ``ar`` in the same process, alternating
which goes first so machine drift hits both equally.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from omnidraft import state as state_io
from omnidraft.config import TaskConfig, check_schema, evaluation_points, target_defaults, task_defaults, task_templates
from omnidraft.core.certify import certify
from omnidraft.core.decode import generate
from omnidraft.core.verifiers import TraceVerifier, rows_at_end
from omnidraft.data.models import LoadedModel, load_model, sliding_window
from omnidraft.data.quality import score as quality_score
from omnidraft.data.quality import summarise_quality
from omnidraft.data.tasks import Record, format_prompt, load_stream, render
from omnidraft.drafting.direct_map import build_bridge, tokenizer_hash
from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.errors import OmniDraftError
from omnidraft.instantiate import call_with, check_targets
from omnidraft.learn.lora import LoraServing, merge_lora_state
from omnidraft.learn.observers import step_observers, use_length_policy
from omnidraft.learn.online import OnlineLearner
from omnidraft.lifecycle import (
    LOGGER_RUNTIME_ARGS,
    RunContext,
    cell_key,
    check_resume,
    command_overrides,
    fingerprint,
    group_choices,
    resolve_dtypes,
    to_plain,
    write_json,
)
from omnidraft.replay import Replay, check_replay_config, machine_calibration, open_replay
from omnidraft.tables import by_target, by_task, drafter_row, prompt_row, read_summary, summarise, train_test_summary

# Arguments the runner can supply when it builds each _target_ node (each gets those it accepts).
RUNTIME_ARGS = {
    "method.drafter": {"model", "tokenizer", "bridge", "target_vocab_size", "target_eos", "verify"},
}


def check_config(cfg: DictConfig) -> None:
    """Everything that can be checked before a model loads: the schema's allowed values and ranges
    (:func:`omnidraft.config.check_schema`), every ``_target_``'s kwargs, then the rules across
    fields, read from what each method declares (``drafts_with``, ``can_adapt``, ...)."""
    check_schema(cfg)
    runtime = dict(RUNTIME_ARGS)
    for name in (cfg.logger or {}):
        runtime[f"logger.{name}"] = LOGGER_RUNTIME_ARGS
    check_targets(cfg, runtime)
    m, dl = cfg.method, cfg.method.draft_length
    if cfg.engine == "replay":
        check_replay_config(cfg)
    check_target_switch(cfg)
    if m.engine == "hf_assisted":
        if m.temperature > 0 or m.adapt.enabled or dl.policy != "fixed":
            raise OmniDraftError(f"method {m.name!r} runs transformers' assisted generation: greedy, frozen, "
                                 "its own draft-length schedule (set method.hf.*), no adapt or draft_length")
        if bool(m.hf.assistant) != (m.drafts_with == "model"):
            raise OmniDraftError(f"method {m.name!r}: method.hf.assistant={m.hf.assistant} contradicts "
                                 f"method.drafts_with={m.drafts_with} (an assistant is a drafter model)")
    elif m.drafts_with != "none" and m.drafter is None:
        raise OmniDraftError(f"method {m.name!r} has no drafter config; set method.drafter or use method=ar")
    if uses_draft_model(m) and cfg.drafter is None:
        raise OmniDraftError(f"method {m.name!r} needs a drafter model; pass drafter=<name>")
    if m.adapt.enabled and not m.can_adapt:
        raise OmniDraftError(f"method.adapt.enabled=true needs a drafter that records training data "
                             f"(method.can_adapt: omnidraft.drafting.model_drafters.NgramDrafter), not "
                             f"{m.drafter['_target_'] if m.drafter else 'no drafter'}")
    init_state = cfg.drafter.init_state if cfg.drafter is not None else None
    if init_state:
        check_disjoint(cfg)
    if m.temperature > 0 and m.verify == "lossless" and not m.lossless_sampling:
        raise OmniDraftError("sampling with the n-gram cache has no lossless rule; set method.verify=paper "
                             "(OmniDraft's approximate q', not lossless) or method.temperature=0")
    if m.needs_init_state and not init_state and cfg.protocol != "train_test":  # train_test distils on its train slice
        raise OmniDraftError(f"method={m.name} serves an offline-distilled drafter: run `omnidraft distill` "
                             "first, then pass drafter.init_state=<its run_dir>/state (or use protocol=train_test, "
                             "which distils it on the train slice)")
    if cfg.resume and init_state:
        raise OmniDraftError("resume=true continues this run's own state; drop drafter.init_state")
    dr = m.get("drafter") or {}
    if "eviction" in dr or "capacity" in dr:  # the cache's own rule, checked before any model loads
        from omnidraft.drafting.ngram_cache import NgramCache

        try:
            NgramCache(capacity=dr.get("capacity"), eviction=dr.get("eviction", "lru"))
        except ValueError as e:
            raise OmniDraftError(f"method.drafter: {e} (capacity null = unbounded)") from None
    if not 1 <= dl.k_min <= dl.k_max:
        raise OmniDraftError(f"method.draft_length: need 1 <= k_min <= k_max, got {dl.k_min}..{dl.k_max}")
    if dl.gamma_infer is not None and (dl.head_learn or dl.policy != "head"):
        raise OmniDraftError("method.draft_length.gamma_infer is the frozen head's threshold: add "
                             "method.draft_length.policy=head method.draft_length.head_learn=false, or use gamma")
    if dl.policy != "fixed" and m.drafts_with == "none":
        raise OmniDraftError(f"method={m.name} drafts nothing: drop method.draft_length.policy")


def check_disjoint(cfg: DictConfig) -> None:
    """Compare this run's prompts with those drafter.init_state was trained on: refuse an overlap
    with a DistillSpec training split (an offline training set), warn on an overlap with the
    stream an online state adapted on (re-serving it is legitimate; a benchmark on it is not)."""
    meta_path = Path(cfg.drafter.init_state) / "meta.json"
    if not meta_path.exists():
        return  # load() reports a missing state with its own message
    meta = state_io.read_meta(meta_path)
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


def uses_draft_model(m) -> bool:
    """Whether a method needs a drafter LM (``method.drafts_with: model``; prompt lookup and the
    target alone do not)."""
    return m.drafts_with == "model"


def _load_init_weights(model, init, part: state_io.SavedState | None) -> None:
    """Serve a saved drafter state frozen: its weights (a full fine-tune's are every target's), or
    the LoRA adapters of this target's ``part`` merged into the weights (none: the base drafter)."""
    if init.meta.get("lora"):
        if part is not None:
            merge_lora_state(model, part.tensors, tuple(init.meta["lora"]))
    else:
        state_io.load_weights(model, init.tensors)


def switch_schedule(cfg: DictConfig) -> list[tuple[int, str]]:
    """(first prompt, target name) of each segment of the stream: ``target_switch``'s, or one
    segment on the run's target."""
    ts = cfg.get("target_switch")
    if ts is None or not ts.targets:
        return [(0, str(cfg.target.name))]
    return list(zip([0, *(int(a) for a in ts.at)], [str(t) for t in ts.targets]))


def switch_target_node(cfg: DictConfig, name: str) -> DictConfig:
    """The config node of target ``name`` of a run: its own ``target`` node for the run's target,
    else conf/target/<name>.yaml (:func:`omnidraft.config.target_defaults`) running as the run's
    target does (its ``dtype`` and ``device``)."""
    if name == cfg.target.name:
        return cfg.target
    node = target_defaults(name).copy()
    OmegaConf.set_readonly(node, False)  # the cached node stays read-only
    node.dtype, node.device = cfg.target.dtype, cfg.target.device
    return node


def check_target_switch(cfg: DictConfig) -> None:
    """What ``target_switch`` needs, checked before any model loads.

    Raises:
        OmniDraftError: another protocol, a method that does not draft with a model in this
            package's loop, a malformed schedule, a first target that is not the run's, or an
            unknown target name.
    """
    ts, m = cfg.target_switch, cfg.method
    if not ts.targets and not ts.at:
        return
    if cfg.protocol != "stream":
        raise OmniDraftError(f"target_switch switches the target of a stream; protocol={cfg.protocol} evaluates one "
                             "target: drop target_switch or use protocol=stream")
    if not uses_draft_model(m) or m.engine != "omnidraft":
        raise OmniDraftError(f"target_switch swaps the per-target parts of a drafter model in this package's decode "
                             f"loop; method={m.name} has none (drafts_with={m.drafts_with}, engine={m.engine}): use "
                             "a model drafter, e.g. method=omnidraft")
    if len(ts.targets) < 2 or len(ts.at) != len(ts.targets) - 1:
        raise OmniDraftError(f"target_switch: give n >= 2 targets and the n - 1 prompts where each next one takes "
                             f"over (got {len(ts.targets)} targets, {len(ts.at)} switch points), e.g. "
                             "target_switch.targets=[a,b,a] target_switch.at=[100,200]")
    at = [int(a) for a in ts.at]
    if at[0] < 1 or any(b <= a for a, b in zip(at, at[1:])):
        raise OmniDraftError(f"target_switch.at={at}: the switch points must rise strictly, from >= 1")
    if ts.get("schedule") is not None and ts.get("schedules"):  # a named schedule (experiment paper/target_switch)
        if ts.schedule not in ts.schedules:
            raise OmniDraftError(f"target_switch.schedule={ts.schedule}: no such schedule; known: "
                                 f"{', '.join(ts.schedules)}")
        if list(ts.targets) != list(ts.schedules[ts.schedule]):
            raise OmniDraftError(f"target_switch.targets={list(ts.targets)} is given, but target_switch.schedule="
                                 f"{ts.schedule} picks {list(ts.schedules[ts.schedule])}: with your own list pass "
                                 f"target={ts.targets[0]} target_switch.schedule=null")
    missing = [str(t) for t in ts.targets if str(t).startswith("no_partner_for_")]
    if missing:
        name = missing[0].removeprefix("no_partner_for_")
        raise OmniDraftError(f"target_switch.partners has no partner for {name}: add "
                             f"target_switch.partners.{name}=<another target>, or use target_switch.schedule=stay")
    if ts.targets[0] != cfg.target.name:
        raise OmniDraftError(f"target_switch.targets starts with {ts.targets[0]} but the run's target is "
                             f"{cfg.target.name}: the stream starts on the run's target; pass target={ts.targets[0]}")
    for name in ts.targets:
        try:
            target_defaults(str(name))
        except OmniDraftError as e:
            raise OmniDraftError(f"target_switch.targets: {e}") from None


@dataclass
class TargetParts:
    """What the drafter keeps for one target tokenizer (one drafter serves many targets).

    Attributes:
        key: the target's tokenizer hash.
        name: the run's first target with that tokenizer.
        bridge: the direct map drafter -> that target.
        drafter: the drafter built on that map (its n-gram cache, when it has one).
        policy: its draft-length policy.
        head: its acceptance-head learner (policy=head), else None.
        observers: the observers of its steps, in the canonical order.
        learner_part: the online learner's part for it while another target's is the learner's
            (:meth:`omnidraft.learn.online.OnlineLearner.target_state`: LoRA adapters and moments,
            unflushed examples); None: the learner holds it, or it starts fresh.
        lora: LoRA adapters served frozen for it (no learner, target_switch), from drafter.init_state.
    """

    key: str
    name: str
    bridge: Any
    drafter: Any
    policy: Any
    head: Any
    observers: list
    learner_part: tuple[dict[str, torch.Tensor], dict] | None = None
    lora: dict[str, torch.Tensor] | None = None


# A target's drafter parts, as the messages about drafter.init_state name them.
_PART_NAMES = {"ngram": "n-gram cache", "lora": "LoRA adapters", "head": "acceptance head"}


class Session:
    """Loaded models + drafter for one (target, drafter, method): what notebooks use.

    With ``target_switch`` it holds several targets (each loaded once) and, per target tokenizer,
    the drafter's parts (:class:`TargetParts`); :meth:`use_target` switches between them. The
    drafter model, and full fine-tuning's weights, are one and serve every target."""

    def __init__(self, cfg: DictConfig, target: LoadedModel | None = None, draft: LoadedModel | None = None):
        """``target`` / ``draft``: already loaded models to share (the bench loads the target once,
        and one frozen base drafter for every method that neither trains nor loads a state)."""
        self.cfg = cfg
        cache = Path(cfg.paths.cache_dir)
        self.schedule = switch_schedule(cfg)  # (first prompt, target) of each segment
        first = str(cfg.target.name)
        self.target_cfgs: dict[str, DictConfig] = {name: switch_target_node(cfg, name) for _, name in self.schedule}
        self.targets: dict[str, LoadedModel] = {
            first: target if target is not None else load_model(to_plain(cfg.target), cache)}
        for name, node in self.target_cfgs.items():  # each distinct target loads once
            if name not in self.targets:
                self.targets[name] = load_model(to_plain(node), cache)
        self.target: LoadedModel = self.targets[first]  # the active target
        self.target_name, self.target_cfg = first, cfg.target
        self.draft_lm: LoadedModel | None = None
        self.drafter = None
        self.bridge = None
        self.learner = None
        self.lora = None
        self.head_learner = None
        self.length_policy = None  # the model drafter's draft-length policy (omnidraft.learn.draft_length)
        self.observers: list = []  # learn from every step, in this order (omnidraft.core.feedback)
        self.verifier: TraceVerifier | None = None  # engine=replay (use_trace); None: the target verifies
        self.parts: dict[str, TargetParts] = {}  # model drafters: by target tokenizer hash
        self.init_info: dict[str, Any] = {}  # drafter/init_*: what drafter.init_state gave each target
        self._keys: dict[str, str] = {}  # target name -> tokenizer hash
        self._active: str | None = None  # the tokenizer hash whose parts are in use
        # other targets' parts read from a state (drafter.init_state, resume), written back untouched
        self._carried: dict[str, tuple[str | None, state_io.SavedState]] = {}
        self._verifiers: dict[str, TraceVerifier] = {}
        self._lora_serving: LoraServing | None = None
        self._task: str | None = None
        self._wired: str | None = None  # the target whose observers are wired (use_target)
        self._observing = True
        self.hf = None
        m = cfg.method
        if m.engine == "hf_assisted":
            from omnidraft.drafting.hf_assisted import HFAssisted

            hf = to_plain(m.hf)
            if hf.pop("assistant"):
                self.draft_lm = draft if draft is not None else load_model(to_plain(cfg.drafter), cache)
                if cfg.drafter.init_state:
                    init = state_io.load(cfg.drafter.init_state)
                    parts = self._init_parts(init, {first: self.target_key(first)})
                    self._report_init(init, parts, ngram=False, lora=bool(init.meta.get("lora")), head=False)
                    _load_init_weights(self.draft_lm.model, init, parts[self.target_key(first)])
            dm = self.draft_lm
            self.hf = HFAssisted(self.target.model, dm.model if dm else None, self.target.tokenizer,
                                 dm.tokenizer if dm else None, **hf)
        elif m.drafts_with == "lookup":  # model-free drafting (prompt lookup)
            v_t = self.target.model.get_output_embeddings().weight.shape[0]
            self.drafter = call_with(instantiate(m.drafter), target_vocab_size=v_t, target_eos=self.target.eos_ids,
                                     tokenizer=self.target.tokenizer)
        elif m.drafts_with == "model":
            self._build_model_drafter(draft, cache)

    def _build_model_drafter(self, draft: LoadedModel | None, cache: Path) -> None:
        """The drafter model, its online learner (one: the drafter model is one) and, per target
        tokenizer, its parts (:class:`TargetParts`), each from ``drafter.init_state`` where that
        state holds them; then the run's first target in use."""
        cfg, m = self.cfg, self.cfg.method
        self.draft_lm = draft if draft is not None else load_model(to_plain(cfg.drafter), cache)
        keys = {name: self.target_key(name) for name in self.targets}
        if m.needs_same_tokenizer:
            d_key = tokenizer_hash(self.draft_lm.tokenizer)
            for name, key in keys.items():
                if key != d_key:
                    raise OmniDraftError(
                        f"method={m.name} needs a drafter that shares the target's tokenizer; {cfg.drafter.name} "
                        f"and {name} differ: use method=spd_dm")
        bridges = {}
        for name, key in keys.items():
            if key not in bridges:
                bridges[key] = build_bridge(self.draft_lm.tokenizer, self.targets[name].tokenizer, cache)
        a = m.adapt
        init = state_io.load(cfg.drafter.init_state) if cfg.drafter.init_state else None
        lora = (a.lora_rank, a.lora_alpha, list(a.lora_target_modules)) if a.enabled and a.lora_rank else None
        if init is not None and init.meta.get("lora") and lora is None:
            lora = tuple(init.meta["lora"])  # serve an adapted LoRA drafter with its adapters
        self.lora = list(lora) if lora else None
        # LoRA adapters live on the learner's training copy; the served drafter stays plain
        # and gets the merged weights (no adapter matmuls while drafting).
        self.learner = OnlineLearner(
            self.draft_lm.model, bridges[keys[self.target_name]], lam=a.lam, loss=a.loss, lr=a.lr,
            weight_decay=a.weight_decay, batch_size=a.batch_size,
            steps_per_update=a.steps_per_update, seed=int(cfg.seed),
            context_grad=a.context_grad, train_dtype=a.train_dtype, positions=a.positions,
            jsd_beta=a.jsd_beta, lora=lora) if a.enabled else None
        init_parts = self._init_parts(init, keys) if init is not None else {}
        external = init is not None and bool(init.meta.get("weights_external"))  # Decoder.save_pretrained's
        if external and cfg.drafter.source not in ("local", "given"):
            import warnings

            warnings.warn(f"drafter.init_state={cfg.drafter.init_state} is an export whose weights are in its model "
                          "directory; load the drafter from there (drafter.source=local drafter.path=<that dir>)",
                          stacklevel=2)
        if init is not None and not init.meta.get("lora") and not external:  # a full fine-tune's weights: every target's
            if self.learner is not None:
                self.learner.load_state_dict(init.tensors, init.meta.get("learner") or {}, weights_only=True)
            else:
                state_io.load_weights(self.draft_lm.model, init.tensors)
        factory = instantiate(m.drafter)
        for name, key in keys.items():
            if key not in self.parts:
                self.parts[key] = self._target_parts(name, key, bridges[key], factory, init_parts.get(key))
        if init is not None:
            ngram = bool(cfg.drafter.init_ngram) and isinstance(self.parts[keys[self.target_name]].drafter,
                                                                NgramDrafter)
            head = m.draft_length.policy == "head"
            self._report_init(init, init_parts, ngram=ngram, lora=bool(self.lora), head=head)
            self._carry_others(init, set(keys.values()))
        if self.learner is None and self.lora and init is not None:  # LoRA served frozen
            if len(self.parts) > 1:  # each target's adapters merged in turn (use_target)
                self._lora_serving = LoraServing(self.draft_lm.model, self.lora)
            else:
                _load_init_weights(self.draft_lm.model, init, init_parts.get(keys[self.target_name]))
        self.use_target(self.target_name)

    def target_key(self, name: str) -> str:
        """The tokenizer hash of target ``name`` (what its drafter parts are keyed by)."""
        if name not in self._keys:
            self._keys[name] = tokenizer_hash(self.targets[name].tokenizer)
        return self._keys[name]

    def _init_parts(self, init: state_io.SavedState, keys: dict[str, str]) -> dict[str, state_io.SavedState | None]:
        """The parts ``init`` (drafter.init_state) holds for each target tokenizer of this run
        (:func:`omnidraft.state.target_part`). A state that does not record its target (from before
        targets were recorded) is taken as the run's first target's."""
        if state_io.active_target(init.meta)[0] is None:
            first = keys[self.target_name]
            return {key: init if key == first else None for key in keys.values()}
        return {key: state_io.target_part(init, key) for key in keys.values()}

    def _report_init(self, init: state_io.SavedState, parts: dict[str, state_io.SavedState | None], *,
                     ngram: bool, lora: bool, head: bool) -> None:
        """Say what ``drafter.init_state`` gave each target (``drafter/init_ngram``, ``_lora``,
        ``_head`` in :attr:`init_info`: ``loaded`` or ``empty (...)``). A target the state holds no
        parts for starts them empty, with one warning line; ``drafter.strict_target`` refuses.
        Full fine-tuning's weights are not parts: they serve every target."""
        kinds = [k for k, v in (("ngram", ngram), ("lora", lora), ("head", head)) if v]
        if not kinds:
            return
        has = {"ngram": lambda p: "drafter" in p.meta,
               "lora": lambda p: any(k.startswith("param.") for k in p.tensors),
               "head": lambda p: any(k.startswith("head.") for k in p.tensors)}
        self._check_unrecorded(init, [k for k in kinds if has[k](init)])
        names = state_io.target_names(init.meta)
        built = ", ".join(n or f"tokenizer {state_io.target_key(h)}" for h, n in names.items()) or "<not recorded>"
        firsts = {}
        for name in self.targets:
            firsts.setdefault(self.target_key(name), name)
        lacking = [name for key, name in firsts.items() if parts.get(key) is None]
        for kind in kinds:
            per = {}
            for key, name in firsts.items():
                p = parts.get(key)
                per[name] = ("empty (state built for target " + built + ")" if p is None
                             else "loaded" if has[kind](p) else "empty (none in the state)")
            self.init_info[f"drafter/init_{kind}"] = per[self.target_name] if len(per) == 1 else per
        if not lacking:
            return
        parts_txt = ", ".join(_PART_NAMES[k] for k in kinds)
        them = ", ".join(lacking)
        path = self.cfg.drafter.init_state
        if self.cfg.drafter.strict_target:
            raise OmniDraftError(f"drafter.init_state={path} holds the drafter parts ({parts_txt}) of target {built}, "
                                 f"none of target {them} (another tokenizer), and drafter.strict_target=true: serve it "
                                 f"on {built}, or drop drafter.strict_target to start {them}'s parts empty")
        import warnings

        warnings.warn(f"drafter.init_state={path} was built for target {built}; target {them} has another tokenizer, "
                      f"so its {parts_txt} start empty (drafter.strict_target=true refuses)", stacklevel=3)

    def _check_unrecorded(self, init: state_io.SavedState, held: list[str]) -> None:
        """A state that records no target tokenizer (from before targets were recorded) serves the
        run's first target: quietly where it names that target, else with one warning line
        (``drafter.strict_target`` refuses), since its parts may be another tokenizer's."""
        h, name = state_io.active_target(init.meta)
        if h is not None or not held or name == self.target_name:
            return
        parts_txt = ", ".join(_PART_NAMES[k] for k in held)
        path, built = self.cfg.drafter.init_state, name or "<not recorded>"
        if self.cfg.drafter.strict_target:
            raise OmniDraftError(f"drafter.init_state={path} records no target tokenizer (built for target {built}) "
                                 f"and drafter.strict_target=true: its {parts_txt} may be another tokenizer's; serve "
                                 f"it on {built}, or drop drafter.strict_target to take them as {self.target_name}'s")
        import warnings

        warnings.warn(f"drafter.init_state={path} records no target tokenizer (built for target {built}): its "
                      f"{parts_txt} are taken as target {self.target_name}'s (drafter.strict_target=true refuses)",
                      stacklevel=3)

    def _carry_others(self, st: state_io.SavedState, live: set[str]) -> None:
        """Keep the parts ``st`` holds for targets this run does not use, to write them back untouched."""
        names = state_io.target_names(st.meta)
        active = state_io.active_target(st.meta)[0]
        if active is not None and active not in live:
            self._carried[active] = (names[active], state_io.active_part(st))
        for h, part in state_io.other_parts(st).items():
            if h not in live:
                self._carried[h] = (names.get(h), part)

    def _target_parts(self, name: str, key: str, bridge, factory, init: state_io.SavedState | None) -> TargetParts:
        """One target tokenizer's parts, from ``init`` (its parts in drafter.init_state) where given."""
        lm, cfg = self.targets[name], self.cfg
        v_t = lm.model.get_output_embeddings().weight.shape[0]
        drafter = call_with(factory, model=self.draft_lm.model, tokenizer=self.draft_lm.tokenizer,
                            bridge=bridge, target_vocab_size=v_t, target_eos=lm.eos_ids, verify=cfg.method.verify)
        if init is not None and cfg.drafter.init_ngram and "drafter" in init.meta \
                and isinstance(drafter, NgramDrafter):
            drafter.load_state_dict(init.meta["drafter"])  # the adapted stream's n-gram cache
        policy, head = self._length_policy(drafter, init, name)
        # The observers, in the order the drafter once called them: length policy, head, learner, cache.
        observers = step_observers(drafter, policy=policy, head=head, learner=self.learner)
        adapters = {k: v for k, v in init.tensors.items() if k.startswith("param.")} \
            if init is not None and self.lora else None
        return TargetParts(key, name, bridge, drafter, policy, head, observers,
                           learner_part=(adapters, {}) if adapters and self.learner is not None else None,
                           lora=adapters if self.learner is None else None)

    def use_target(self, name: str) -> None:
        """Verify with target ``name`` (one of this session's) from now on; a model drafter then
        drafts with the parts of its tokenizer (direct map, n-gram cache, draft-length policy,
        acceptance head) and the online learner holds its part (LoRA adapters, merged into the
        served drafter, and their moments; unflushed examples). The other targets' parts stay as
        they were."""
        if name == self._wired:
            return
        if name not in self.targets:
            raise OmniDraftError(f"no target {name!r} in this session (it has {', '.join(self.targets)})")
        if self.parts:
            self._use_parts(self.target_key(name))
        self.target, self.target_name, self.target_cfg = self.targets[name], name, self.target_cfgs[name]
        self.verifier = self._verifiers.get(name)
        self._wire_observers()

    def _use_parts(self, key: str) -> None:
        """Draft with the parts of tokenizer ``key``: the learner's part for the target in use is
        parked (copied) in its :class:`TargetParts`, the new one's loaded (fresh the first time)."""
        if key == self._active:
            return
        new, cur = self.parts[key], self.parts.get(self._active)
        if self.learner is not None:
            if cur is not None:
                cur.learner_part = self.learner.target_state()
            self.learner.use_bridge(new.bridge)
            if cur is not None or new.learner_part is not None:  # else the learner's part is fresh already
                self.learner.load_target_state(*(new.learner_part or (None, None)))
            new.learner_part = None  # the learner holds it now
            if new.head is not None and new.head.in_learner:
                self.learner.head = new.head  # trained jointly in the drafter's update
        elif self._lora_serving is not None:
            self._lora_serving.use(new.lora)
        self._active = key
        self.bridge, self.drafter, self.length_policy, self.head_learner = new.bridge, new.drafter, new.policy, new.head
        if self._task is not None:
            self.set_task(self._task)

    def _wire_observers(self) -> None:
        """The active target's observers (none without a model drafter), fed at the end of each
        generation under replay."""
        base = self.parts[self._active].observers if self.parts else []
        self.observers = rows_at_end(base, self.verifier) if self.verifier is not None else list(base)
        self._wired = self.target_name

    def target_for(self, i: int) -> str:
        """The target of the stream's prompt ``i`` (``target_switch``; else the run's target)."""
        name = self.schedule[0][1]
        for start, n in self.schedule:
            if i >= start:
                name = n
        return name

    def segments(self, n: int) -> list[tuple[str, int, int]]:
        """(target, first prompt, end) of each segment of a stream of ``n`` prompts."""
        ends = [s for s, _ in self.schedule[1:]] + [n]
        return [(name, s, min(e, n)) for (s, name), e in zip(self.schedule, ends) if s < n]

    def use_trace(self, trajectories: dict[tuple[int, ...], list[int]], rows: str = "batched",
                  target: str | None = None, store_dir: str | None = None,
                  target_identity: dict[str, Any] | None = None) -> None:
        """Verify by replaying the target's recorded greedy trajectories (``engine=replay``)
        instead of running the target per step. Observers that learn from the target's rows get
        them at the end of each generation, from two batched target forwards
        (:func:`omnidraft.core.verifiers.rows_at_end`; ``rows``: ``batched`` or ``stepwise``, see
        :class:`omnidraft.core.verifiers.TraceVerifier`). ``target``: whose trajectories (default
        the active target). ``store_dir``: keep the rows' trajectory half there between runs
        (:class:`omnidraft.replay.TrajectoryStore`, keyed by ``target_identity``, the trace's)."""
        from omnidraft.replay import TrajectoryStore

        name = target or self.target_name
        base = self.parts[self.target_key(name)].observers if self.parts else []
        needs_rows = any(getattr(o, "needs_rows", False) for o in base)
        model = self.targets[name].model if needs_rows else None
        store = TrajectoryStore(store_dir, target_identity or {}, model) if store_dir and model is not None else None
        self._verifiers[name] = TraceVerifier(trajectories, target=model, rows=rows, store=store)
        if name == self.target_name:
            self.verifier = self._verifiers[name]
            self._wire_observers()

    def prompt_ids(self, text: str | list[dict[str, str]], task=None, target: str | None = None) -> list[int]:
        """Target token ids for one user message or a conversation (chat template when the
        target has one and its ``chat_template``), with the system prompt of ``task`` (a task
        config node; default the run's: another one for protocol=train_test's train slice), for
        ``target`` (default the active one)."""
        name = target or self.target_name
        return format_prompt(self.targets[name].tokenizer, text, system=(task or self.cfg.task).system_prompt,
                             use_chat_template=self.target_cfgs[name].chat_template)

    def templates(self, task=None) -> dict[str, str]:
        """The prompt templates of ``task`` (default the run's task node)."""
        return task_templates(task or self.cfg.task)

    def generate(self, prompt_ids: list[int], *, baseline: bool = False, seed: int = 0,
                 max_new_tokens: int | None = None):
        m = self.cfg.method
        g = torch.Generator().manual_seed(seed)
        n_new = max_new_tokens or self.cfg.decode.max_new_tokens
        if self.hf is not None and not baseline:
            return self.hf.generate(prompt_ids, max_new_tokens=n_new, eos_ids=self.target.eos_ids,
                                    temperature=m.temperature, generator=g)
        verifier = self.verifier if self.verifier is not None and not baseline else self.target.model
        return generate(verifier, prompt_ids, drafter=None if baseline else self.drafter,
                        k=self.draft_k(), max_new_tokens=n_new,
                        eos_ids=self.target.eos_ids, temperature=m.temperature, generator=g,
                        observers=self.observers if self._observing else ())

    def _length_policy(self, drafter, init: state_io.SavedState | None = None, target: str | None = None):
        """``drafter``'s draft-length policy and, for policy=head, its acceptance-head learner (the
        head of ``init``, this target's parts in drafter.init_state, where it holds one)."""
        from omnidraft.learn.acceptance_head import AcceptanceHead, HeadLearner
        from omnidraft.learn.draft_length import ConfidenceK, CostK, FixedK, HeadPolicy, HeuristicK

        dl, m = self.cfg.method.draft_length, self.cfg.method
        if dl.policy == "cost":  # from this machine's latencies (the calibration replay reads too)
            cal = machine_calibration(self.cfg, True, "method.draft_length.policy=cost chooses draft lengths from")
            policy = CostK(cal.target_s, cal.drafter_s, k_max=dl.k_max)
            use_length_policy(drafter, policy)
            return policy, None
        if dl.policy == "confidence":
            policy = ConfidenceK(dl.min_prob, k_min=dl.k_min)
            use_length_policy(drafter, policy)
            return policy, None
        if dl.policy in ("fixed", "heuristic"):
            policy = FixedK() if dl.policy == "fixed" else HeuristicK(k_start=m.k, k_min=dl.k_min, k_max=dl.k_max)
            use_length_policy(drafter, policy)
            return policy, None
        gamma = self._gamma(self.cfg.task.name)
        head = AcceptanceHead(int(self.draft_lm.model.config.hidden_size), dl.head_blocks).to(self.draft_lm.model.device)
        head_init = {k[len("head."):]: v for k, v in (init.tensors if init is not None else {}).items()
                     if k.startswith("head.")}
        if head_init:  # the head an earlier stream trained serves this one
            head.load_state_dict(head_init)
        elif not dl.head_learn:
            why = f" (drafter.init_state holds none for target {target})" if self.cfg.drafter.init_state else ""
            raise OmniDraftError("method.draft_length.head_learn=false serves a trained head: pass "
                                 f"drafter.init_state=<a run with policy=head>/state{why}")
        head_learner = HeadLearner(head, mode=dl.head_mode, lr=dl.head_lr, mismatch_weight=dl.mismatch_weight,
                                   batch_size=dl.head_batch_size, replay=dl.replay, steps=dl.head_steps,
                                   every=dl.head_every, seed=int(self.cfg.seed), learn=dl.head_learn,
                                   label=dl.head_label)
        if dl.head_mode == "joint" and dl.head_learn and self.learner is not None:
            self.learner.attach_head(head_learner)  # one update on L_distill + L_head
        policy = HeadPolicy(head, gamma=gamma, k_min=dl.k_min, k_max=dl.k_max)
        use_length_policy(drafter, policy)
        return policy, head_learner

    def _gamma(self, task: str) -> float:
        """The head's stop threshold: gamma_infer (a frozen head), gamma, or ``task.head_gamma`` of
        ``task`` (this run's task node; another task's conf/task YAML, for mixed streams and the bench)."""
        dl, t = self.cfg.method.draft_length, self.cfg.task
        if not dl.head_learn and dl.gamma_infer is not None:
            return float(dl.gamma_infer)
        if dl.gamma is not None:
            return float(dl.gamma)
        return float(t.head_gamma if task == t.name else task_defaults(task).head_gamma)

    def set_task(self, task: str) -> None:
        """The prompt about to be decoded comes from ``task`` (mixed streams, the bench): a head
        whose gamma is the task's ``head_gamma`` takes that task's."""
        self._task = task  # a target switched to later takes it too
        if self.head_learner is not None:  # the policy is then a HeadPolicy
            self.length_policy.gamma = self._gamma(task)

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

    def learns(self) -> bool:
        """Whether decoding can change what later prompts see: an online learner, an acceptance head
        that trains, an n-gram cache that grows, a draft-length schedule that carries over (each
        observer's ``learns``), transformers' heuristic."""
        return self.hf is not None or any(getattr(o, "learns", True) for o in self.observers)

    @contextlib.contextmanager
    def paused(self):
        """Warm-up context: no observer learns (drafter, head, length policy and n-gram cache stay
        as they were), and the drafter's counters (or transformers' heuristic draft length, for the
        uag methods) are restored afterwards."""
        owner = self.hf if self.hf is not None else self.drafter
        self._observing = False
        try:
            with (owner.paused() if owner is not None else contextlib.nullcontext()):
                yield self
        finally:
            self._observing = True

    def state(self, next_index: int, rows: list[dict[str, Any]], meta: dict[str, Any]) -> state_io.SavedState:
        """The online state after ``next_index`` prompts: the active target's parts at the top level
        (its tokenizer in ``meta["tokenizers"]``), every other target's under
        ``targets.<hash12>.`` (:mod:`omnidraft.state`), those of targets this run never used as
        they were read."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {**meta, "next_index": next_index, "lora": self.lora if self.draft_lm is not None else None,
                "tokenizers": {**(meta.get("tokenizers") or {}), "target": self.target_key(self.target_name),
                               "target_name": self.target_name}}
        if self.learner is not None:
            tensors, meta["learner"] = self.learner.state_dict()
        if self.head_learner is not None:
            head_tensors, meta["head"] = self.head_learner.state_dict()
            tensors = {**tensors, **head_tensors}
        if self.length_policy is not None:
            meta["policy"] = self.length_policy.state_dict()
        if isinstance(self.drafter, NgramDrafter):
            meta["drafter"] = self.drafter.state_dict()  # the n-gram cache
        if self.hf is not None:
            meta["hf"] = self.hf.state_dict()  # transformers' heuristic draft length (uag_k5)
        others = dict(self._carried)
        others.update({key: (p.name, self._parked_state(p)) for key, p in self.parts.items() if key != self._active})
        version = self.learner.weights_version if self.learner is not None else None
        return state_io.with_targets(state_io.SavedState(meta, tensors, rows, version), others)

    def _parked_state(self, p: TargetParts) -> state_io.SavedState:
        """A target's parts while another's are in use, in the state's top-level layout."""
        meta: dict[str, Any] = {"lora": self.lora}
        tensors: dict[str, torch.Tensor] = {}
        if isinstance(p.drafter, NgramDrafter):
            meta["drafter"] = p.drafter.state_dict()
        if p.head is not None:
            head_tensors, meta["head"] = p.head.state_dict()
            tensors.update(head_tensors)
        meta["policy"] = p.policy.state_dict()
        if p.learner_part is not None:
            tensors.update(p.learner_part[0])
            meta["learner"] = p.learner_part[1]
        return state_io.SavedState(meta, tensors)

    def restore(self, st: state_io.SavedState) -> None:
        """Continue from a state this session's config saved (``resume``): every target's parts."""
        active = state_io.active_target(st.meta)[0]
        if active in self.parts:  # its top-level parts are that target's
            self.use_target(self.parts[active].name)
        if self.learner is not None:
            self.learner.load_state_dict(st.tensors, st.meta["learner"])
        if "drafter" in st.meta:
            self.drafter.load_state_dict(st.meta["drafter"])
        if self.head_learner is not None:
            self.head_learner.load_state_dict(st.tensors, st.meta["head"])
        if "policy" in st.meta:
            self.length_policy.load_state_dict(st.meta["policy"])
        if self.hf is not None and "hf" in st.meta:
            self.hf.load_state_dict(st.meta["hf"])
        names = state_io.target_names(st.meta)
        for key, part in state_io.other_parts(st).items():
            p = self.parts.get(key)
            if p is None:
                self._carried[key] = (names.get(key), part)
                continue
            if "drafter" in part.meta:
                p.drafter.load_state_dict(part.meta["drafter"])
            if p.head is not None and "head" in part.meta:
                p.head.load_state_dict(part.tensors, part.meta["head"])
            if "policy" in part.meta:
                p.policy.load_state_dict(part.meta["policy"])
            if self.learner is not None:
                p.learner_part = state_io.learner_part(part.tensors, part.meta["learner"], bool(self.lora)) \
                    if "learner" in part.meta else None

    def drafter_stats(self) -> dict[str, float]:
        return self.drafter.stats() if self.drafter is not None else {}

    def check_context(self, rid: str, n_prompt: int, target: str | None = None) -> None:
        need = n_prompt + self.cfg.decode.max_new_tokens
        for role, lm in (("target", self.targets[target or self.target_name]), ("drafter", self.draft_lm)):
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


def distill_on_train_slice(cfg: DictConfig) -> dict[str, Any] | None:
    """``protocol=train_test`` with an offline-distilled method (DistillSpec, ``method.needs_init_state``)
    and no ``drafter.init_state``: distil the drafter on the TRAIN slice first (``omnidraft distill``'s
    :func:`omnidraft.distill_command.run_distill`, into ``<run_dir>/distill``; a cut distillation
    continues, a finished one is reused), then serve it frozen on the test prompts: the paper's
    protocol with the offline baseline's training budget equal to the online methods' train stream.
    Sets ``cfg.drafter.init_state``.

    Returns:
        The distillation's summary (None when nothing was distilled here).
    """
    m = cfg.method
    if cfg.protocol != "train_test" or not m.needs_init_state or cfg.drafter.init_state:
        return None
    from omnidraft.distill_command import run_distill

    d_dir = Path(cfg.run_dir) / "distill"
    done = read_summary(d_dir) if (d_dir / "summary.json").exists() else {}
    if done.get("status") != "ok" or not (d_dir / "state" / "meta.json").exists():
        dcfg = train_stream_config(cfg)
        with open_dict(dcfg):
            dcfg.run_dir = str(d_dir)
            dcfg.protocol, dcfg.engine = "stream", "live"  # the distillation decodes its own data, live
            dcfg.resume = (d_dir / "data" / "meta.json").exists()  # a cut data build continues
        done = run_distill(dcfg)
        if done.get("status") != "ok":
            raise OmniDraftError(f"the distillation on the train slice stopped ({done.get('status')}); see {d_dir}")
    with open_dict(cfg):
        cfg.drafter.init_state = str(d_dir / "state")
    return done


def train_stream_config(cfg: DictConfig) -> DictConfig:
    """The config of ``protocol=train_test``'s TRAIN stream: ``cfg`` with its task node replaced by
    the train slice (``task.train``: the same task from ``task.train.offset``, or another task,
    ``train_test.train_limit`` prompts) and its recorded overrides rewritten to match, so that the
    trace and the commands derived from it (:func:`omnidraft.trace.trace_command`) are the train
    stream's."""
    tr = cfg.task.train
    return task_slice_config(cfg, tr.task, int(tr.offset), int(cfg.train_test.train_limit))


def task_slice_config(cfg: DictConfig, task: str | None, offset: int, limit: int) -> DictConfig:
    """``cfg`` with its task node the prompts ``offset..offset+limit-1`` of ``task`` (None: the run's
    own task; another task: its defaults), its recorded overrides rewritten to match, so that the
    trace a replay of that slice reads, and the command that makes it, are the slice's."""
    t = to_plain(cfg.task)
    same = task in (None, t["name"])
    node = dict(t) if same else to_plain(task_defaults(task))
    node.update(offset=offset, limit=limit, preset=None)
    dropped = ("task.offset", "task.limit", "task.preset") if same else ("task", "task.")

    def key(o: str) -> str:
        return o.split("=")[0].lstrip("+~")

    over = [o for o in command_overrides(cfg)
            if not (key(o) in dropped or (not same and key(o).startswith("task.")))]
    over += ([] if same else [f"task={task}"]) + [f"task.offset={offset}", f"task.limit={limit}"]
    out = cfg.copy()
    with open_dict(out):
        out.task = OmegaConf.merge(OmegaConf.structured(TaskConfig), node)
        out.overrides = over
    return out


def task_switch_segments(cfg: DictConfig, n: int) -> list[tuple[str, int, int, int]]:
    """The task segments of a ``task=switch`` stream of ``n`` prompts: (component task, first stream
    index, end index, the component's own index of the first prompt), so that each replays from its
    task's trace (:func:`task_slice_config`); the stream unshuffled (:func:`check_replay_config`)."""
    t = cfg.task
    comps, off, at = [str(c) for c in t.components], int(t.offset), int(t.switch_at)
    cut = min(max(at - off, 0), n)  # stream index of the first prompt of the second component
    segs = [(comps[0], 0, cut, off), (comps[1], cut, n, max(off - at, 0))]
    return [s for s in segs if s[2] > s[1]]


def target_stream_config(cfg: DictConfig, name: str, start: int, end: int) -> DictConfig:
    """The config of one segment of a target-switching stream, prompts ``start..end-1`` on target
    ``name``: ``cfg`` with that target's node (:func:`switch_target_node`) and that slice of the
    task, its recorded overrides rewritten to match (another target keeps only the run's
    ``target.dtype`` / ``target.device``), so the trace and calibration a replay of the segment
    reads, and the commands that make them (:func:`omnidraft.trace.trace_command`), are that
    target's."""
    def key(o: str) -> str:
        return o.split("=")[0].lstrip("+~")

    own = name == cfg.target.name
    off, n = int(cfg.task.offset) + start, end - start

    def kept(o: str) -> bool:
        k = key(o)
        if k in ("task.offset", "task.limit", "task.preset") or k.startswith("target_switch"):
            return False
        return own or not (k == "target" or (k.startswith("target.") and k not in ("target.dtype", "target.device")))

    over = [o for o in command_overrides(cfg) if kept(o)]
    over += ([] if own else [f"target={name}"]) + [f"task.offset={off}", f"task.limit={n}"]
    out = cfg.copy()
    with open_dict(out):
        out.target = switch_target_node(cfg, name)
        out.task.offset, out.task.limit, out.task.preset = off, n, None
        out.overrides = over
    return out


def check_train_test(test: list[Record], train: list[Record], test_cfg, train_cfg) -> None:
    """Refuse train and test slices that share a prompt (compared by their first turn's raw text,
    before any template).

    Raises:
        OmniDraftError: the overlap, with the slices and how to move the train slice.
    """
    at = {r.turns[0].strip(): j for j, r in enumerate(test)}
    both = [(at[x], i) for i, x in enumerate(r.turns[0].strip() for r in train) if x in at]
    if both:
        j, i = both[0]
        off = int(test_cfg.offset)
        raise OmniDraftError(
            f"protocol=train_test: the train and test slices share {len(both)} prompt(s) (first: test record "
            f"{test[j].id!r} is train prompt {i}); test = {test_cfg.name} {off}..{off + len(test) - 1}, train = "
            f"{train_cfg.name} {int(train_cfg.offset)}..{int(train_cfg.offset) + len(train) - 1}: move "
            f"task.train.offset past the test slice (>= {off + len(test)}) or pass task.train.task=<another task>")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run one experiment; returns the summary (also written to ``run_dir/summary.json``).

    ``protocol=stream``: the task's prompts in order, the drafter adapting online as they go, each
    measured as it is decoded. ``protocol=train_test`` (the paper's): the drafter adapts online over
    a disjoint TRAIN slice (``task.train``, ``train_test.train_limit`` prompts) and is evaluated
    frozen on the TEST prompts (``task``) before training, every ``train_test.eval_every`` train
    prompts and after the last; rows carry ``phase`` (train / test) and, for test rows, ``eval/at``
    (train prompts seen). ``engine=replay`` verifies against target traces
    (:mod:`omnidraft.replay`). ``target_switch`` (stream protocol) switches the target at given
    prompts, the drafter taking each target's parts (:class:`Session`); rows carry ``target`` and
    the summary ``by_target`` (:func:`by_target`).

    With ``checkpoint_every`` the online state (weights, optimiser, n-gram cache, rows, stream
    position) is saved atomically every N (train) prompts, after each evaluation and at the end;
    ``resume=true`` continues from it.
    """
    check_config(cfg)
    resolve_dtypes(cfg)
    cell = cell_key(cfg)  # before anything this run derives (a distilled state's path) joins the config
    distilled = distill_on_train_slice(cfg)
    state_dir = Path(cfg.state_dir) if cfg.state_dir else Path(cfg.run_dir) / "state"
    saved = None
    if cfg.resume and not state_io.exists(state_dir) and not cfg.state_dir:
        import warnings  # killed before its first checkpoint: what it logged is decoded again

        warnings.warn(f"resume=true: {state_dir} holds no checkpoint yet (the run stopped before its first, "
                      f"checkpoint_every={cfg.checkpoint_every}), so the stream starts again from its first prompt",
                      stacklevel=2)
    elif cfg.resume:
        saved = state_io.load(state_dir)
        check_resume(cfg, saved.meta["fingerprint"], f"from {state_dir}",
                     "resume with the run's original overrides, or start a new run_dir")
    ctx = RunContext(cfg, command_overrides(cfg))
    train_test = cfg.protocol == "train_test"
    train_cfg = train_stream_config(cfg) if train_test else None

    t_load = time.perf_counter()
    sess = Session(cfg)
    cache = Path(cfg.paths.cache_dir)
    records = load_stream(to_plain(cfg.task), cache, seed=int(cfg.seed))  # train_test: the TEST prompts
    train_records = load_stream(to_plain(train_cfg.task), cache, seed=int(cfg.seed)) if train_test else []
    load_s = time.perf_counter() - t_load
    switching = len(sess.schedule) > 1
    if switching and sess.schedule[-1][0] >= len(records):
        raise OmniDraftError(f"target_switch.at={[s for s, _ in sess.schedule[1:]]}: the stream has {len(records)} "
                             f"prompts, so target {sess.schedule[-1][1]} would never run; move the switch points "
                             "or raise task.limit")
    if sess.init_info:
        ctx.prov.update(sess.init_info)
        write_json(Path(cfg.run_dir) / "provenance.json", ctx.prov)

    rows: list[dict[str, Any]] = []
    if saved is not None:
        sess.restore(saved)
        rows = list(saved.rows)
        ctx.resume(int(saved.meta["next_index"]), saved.meta.get("segments", []), enumerate(rows))
    else:
        ctx.fresh()
    start = ctx.start
    log = ctx.open_log()

    greedy = cfg.method.temperature <= 0
    replaying = cfg.engine == "replay"  # the trace is the target's output: no ar baseline to measure
    measure = cfg.method.name != "ar" and cfg.measure_baseline and not replaying
    replay: Replay | None = None
    replays: dict[str, Replay] = {}  # by target name: its trace and calibration
    every = max(1, int(cfg.baseline_every))
    adapt_cfg = train_cfg if train_test else cfg
    t = adapt_cfg.task
    meta = {"fingerprint": fingerprint(cfg), "segments": ctx.segments,
            # the prompts this state adapted on (their number is next_index), for runner.check_disjoint
            "train_split": {"task": t.name, "offset": int(t.offset), "shuffle": bool(t.shuffle),
                            "seed": int(cfg.seed)},
            # the target's tokenizer (whose parts are at the top level) is Session.state's
            "tokenizers": {"drafter": tokenizer_hash(sess.draft_lm.tokenizer) if sess.draft_lm else None}}

    skipped: dict[str, str] = {}  # train_test: why the train stream was not decoded

    def summary_of(status: str) -> dict[str, Any]:
        window = int(cfg.metrics_window)
        if train_test:
            summary = train_test_summary(rows, greedy, window)
        else:
            summary = summarise(rows, greedy, window)
            summary.update(summarise_quality(rows))
            summary.update(by_task(rows, greedy, window))
            if switching:
                summary["by_target"] = by_target(rows, greedy, window)
        summary.update({
            "status": status,
            "protocol": cfg.protocol,
            "n_records": len({r["prompt/index"] for r in rows if r.get("phase", "train") == "train"}),
            "method": cfg.method.name, "target": cfg.target.name,
            "drafter": sess.draft_lm.name if sess.draft_lm is not None else None,
            "task": cfg.task.name, "k": int(cfg.method.k), "temperature": float(cfg.method.temperature),
            "verify": cfg.method.verify,
            "max_new_tokens": int(cfg.decode.max_new_tokens),
            "baseline_every": every if measure else None,
            "time/load_s": load_s,
            "resumed_at": ctx.resumed_at,
            "choices": group_choices(), "cell": cell,
        })
        if skipped:
            summary["train/skipped"] = skipped["train"]
        if distilled:  # DistillSpec: distilled offline on the train slice (run_dir/distill), then frozen
            summary["train/distill"] = {k: distilled.get(k) for k in (
                "distill/loss_before", "distill/loss_after", "distill/n_examples", "distill/positions",
                "distill/data_s", "distill/train_s", "n_prompts", "data", "divergence")}
        if train_test:
            summary.update({"train_task": train_cfg.task.name, "train_offset": int(train_cfg.task.offset),
                            "test_offset": int(cfg.task.offset), "n_test": len(records),
                            "eval_every": int(cfg.train_test.eval_every)})
        if sess.bridge is not None:
            summary.update(sess.bridge.stats())
        summary["engine"] = cfg.engine
        if replay is not None:
            summary.update(replay.info)
            ctx.prov["replay"] = replay.info
        summary.update(sess.init_info)
        if switching:
            summary["targets"] = [name for _, name in sess.schedule]
        summary["provenance"] = ctx.prov
        return summary

    with ctx.finishing(summary_of):
        def prompt_ids_of(recs: list[Record], task) -> list[list[int]]:
            out = []
            for i, r in enumerate(recs):  # each prompt in its own target's tokens (target_switch)
                name = sess.target_for(i)
                ids = sess.prompt_ids(render(r, 0, sess.templates(task)), task, target=name)
                sess.check_context(r.id, len(ids), target=name)
                out.append(ids)
            return out

        first = prompt_ids_of(records, cfg.task)
        train_first = prompt_ids_of(train_records, adapt_cfg.task)
        if train_test:
            check_train_test(records, train_records, cfg.task, train_cfg.task)
        stream, stream_first = (train_records, train_first) if train_test else (records, first)
        if replaying:
            uses_model = uses_draft_model(cfg.method)
            if switching:  # each segment from its own target's trace and calibration
                for name, a, b in sess.segments(len(records)):
                    seg = open_replay(target_stream_config(cfg, name, a, b), sess.targets[name].tokenizer,
                                      records[a:b], first[a:b], uses_model)
                    if name in replays:
                        replays[name].trajectories.update(seg.trajectories)
                        replays[name].info["replay/trace_lines"] = len(replays[name].trajectories)
                    else:
                        replays[name] = seg
                replay = replays[sess.schedule[0][1]]
                replay.info["replay/targets"] = {name: dict(r.info) for name, r in replays.items()}
            elif cfg.task.name == "switch":  # each task segment from its own task's trace
                for task, a, b, off in task_switch_segments(cfg, len(records)):
                    seg = open_replay(task_slice_config(cfg, task, off, b - a), sess.target.tokenizer,
                                      records[a:b], first[a:b], uses_model)
                    if replay is None:  # the first task's trace and calibration; the others add their lines
                        replay = seg
                        replay.info["replay/tasks"] = {}
                    else:
                        replay.trajectories.update(seg.trajectories)
                    replay.info["replay/tasks"][task] = {k: v for k, v in seg.info.items() if k.startswith("replay/trace")}
                replay.info["replay/trace_lines"] = len(replay.trajectories)
                replays[sess.target_name] = replay
            else:
                replay = open_replay(cfg, sess.target.tokenizer, records, first, uses_model)
                if train_test:
                    replay.merge(open_replay(train_cfg, sess.target.tokenizer, train_records, train_first, uses_model))
                replays[sess.target_name] = replay
            for name, r in replays.items():
                sess.use_trace(r.trajectories, rows=str(cfg.replay.rows), target=name,
                               store_dir=cfg.replay.rows_cache, target_identity=r.target_identity)
                if cfg.replay.rows_cache:
                    r.info["replay/rows_cache"] = str(cfg.replay.rows_cache)
            ctx.prov["replay"] = replay.info
            write_json(Path(cfg.run_dir) / "provenance.json", ctx.prov)
        warm: dict[str, list[list[int]]] = {}  # each target's first prompts (of its first segment)
        for name, a, _ in sess.segments(len(stream_first)):
            warm.setdefault(name, stream_first[a: a + int(cfg.warmup_prompts)])
        for name, prompts in warm.items():
            sess.use_target(name)
            with sess.paused():
                for ids in prompts:  # warm-up, not logged, learns nothing
                    sess.generate(ids, max_new_tokens=16)
                    if measure:
                        sess.generate(ids, baseline=True, max_new_tokens=16)
        ar_cache: dict[tuple[int, int], Any] = {}  # train_test: each test prompt's ar, measured once

        def decode(r: Record, i: int, ids0: list[int], *, learn: bool, with_ar: bool, stream_task,
                   extra: dict[str, Any]) -> None:
            """Decode every turn of record ``r`` (stream index ``i`` of the stream of task node
            ``stream_task``), log a row per turn; ``learn``: online updates after its last turn."""
            history: list[dict[str, str]] = []
            task = stream_task.name
            for turn in range(len(r.turns)):
                history.append({"role": "user", "content": render(r, turn, sess.templates(stream_task))})
                ids = ids0 if turn == 0 else sess.prompt_ids(history, stream_task)
                if turn:
                    sess.check_context(f"{r.id} turn {turn + 1}", len(ids))
                seed = int(cfg.seed) * 1_000_003 + i + 100_003 * turn
                ar = ar_cache.get((i, turn)) if not learn else None
                ar_first = (i // every) % 2 == 1  # alternates over the measured prompts, whatever `every`
                if with_ar and ar is None and ar_first:
                    ar = sess.generate(ids, baseline=True, seed=seed)
                sess.set_task(r.metadata.get("task", task))
                before = sess.drafter_stats()
                sd = sess.generate(ids, seed=seed)
                if with_ar and ar is None and not ar_first:
                    ar = sess.generate(ids, baseline=True, seed=seed)
                if ar is not None and not learn:
                    ar_cache[(i, turn)] = ar
                answer = sess.target.tokenizer.decode(sd.tokens, skip_special_tokens=True)
                tn = stream_task
                row = {**extra, "prompt/id": r.id, "prompt/index": i, "prompt/turn": turn,
                       "task": r.metadata.get("task", task), "target": sess.target_name, "prompt/tokens": len(ids),
                       **prompt_row(sd, ar),
                       **drafter_row(before, sess.drafter_stats(), len(sd.steps)),
                       **quality_score(r, turn, answer, sd.n_new, execute_code=bool(tn.execute_code),
                                       timeout=float(tn.exec_timeout_s), memory_mb=int(tn.exec_memory_mb))}
                if replays:
                    row.update(replays[sess.target_name].row(sd))
                elif ar is not None and greedy and sd.tokens != ar.tokens:  # a bf16 near-tie, or a bug?
                    row.update(certify(sess.target.model, ids, sd.tokens, ar.tokens) or {})
                row["text/output"] = sess.target.tokenizer.decode(sd.tokens)
                history.append({"role": "assistant", "content": answer})
                if sess.head_learner is not None:
                    row.update(sess.head_learner.calibration())
                if learn and turn == len(r.turns) - 1:
                    row.update(sess.after_prompt(i, progress=bool(cfg.progress)))
                rows.append(row)
                log.log(row, step=len(rows) - 1)

        def postfix(bar, recs: list[dict[str, Any]]) -> None:
            summary = summarise(recs, greedy, int(cfg.metrics_window))
            post = {"acc": f"{summary['accept/rate']:.2f}", "len": f"{summary['accept/mean_len']:.2f}"}
            for key, name in (("speed/speedup", "speedup"), ("speed/modelled_speedup", "modelled")):
                if key in summary:
                    post[name] = f"{summary[key]:.2f}x"
            bar.set_postfix(post)

        evals: list[int] = []
        if train_test:
            n = len(train_records)
            done = {r["eval/at"] for r in rows if r.get("phase") == "test"}
            evals = [e for e in evaluation_points(n, int(cfg.train_test.eval_every), bool(cfg.train_test.eval_at_start),
                                                  sess.learns()) if e not in done]
            if not sess.learns():  # frozen (spd_dm, sd, pld): the train stream cannot change the test set's
                stream, stream_first = [], []
                skipped["train"] = (f"frozen: nothing learns online, so the {n} train prompts cannot change the "
                                    "test prompts' decoding; evaluated once, before them"
                                    + (" (the drafter was distilled offline on them first)" if distilled else ""))
        bar = tqdm(total=len(stream), initial=start, desc=f"{cfg.method.name} {adapt_cfg.task.name}",
                   unit="prompt", disable=not cfg.progress, dynamic_ncols=True)
        for i in range(start, len(stream) + 1):
            while evals and evals[0] <= i:  # frozen: nothing learns, the n-gram cache is put back after
                evals.pop(0)
                with sess.paused():
                    for j, r in enumerate(tqdm(records, desc=f"test after {i} train prompts", unit="prompt",
                                               disable=not cfg.progress, leave=False, dynamic_ncols=True)):
                        decode(r, j, first[j], learn=False, with_ar=measure, stream_task=cfg.task,
                               extra={"phase": "test", "eval/at": i})
                state_io.save(state_dir, sess.state(i, rows, meta))
            if i == len(stream):
                break
            r = stream[i]
            sess.use_target(sess.target_for(i))
            decode(r, i, stream_first[i], learn=True, with_ar=measure and not train_test and i % every == 0,
                   stream_task=adapt_cfg.task, extra={"phase": "train"} if train_test else {})
            if ctx.checkpoint_due(i, len(stream)):
                state_io.save(state_dir, sess.state(i + 1, rows, meta))
            bar.update(1)
            postfix(bar, [x for x in rows if x.get("phase", "train") == "train"])
        bar.close()
    return ctx.summary
