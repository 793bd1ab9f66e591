"""``omnidraft trace``: record the target's greedy decoding of a task's prompts (a target trace).

Under greedy verification speculative decoding emits exactly the target's greedy output, so one
recording of each prompt's greedy trajectory lets later drafter-side experiments replay a stream
without decoding the target again (the replay verifier plugs into :mod:`omnidraft.core.verifiers`;
it reads a trace with :func:`read_trace` and checks it with :func:`check_trace`).

A trace is a directory, by default ``<paths.results_dir>/traces/<target.name>/<task.name>/``
(``trace.out_dir`` overrides it), holding:

- ``meta.json``, written before the first line and rewritten atomically at each start:
  ``format``; ``identity``, what every line depends on: the target (name, source, hub id, revision,
  path, dtype, device, ``chat_template`` flag, ``tokenizer_hash``, the applied chat template's
  ``chat_template_sha256``), ``max_new_tokens``, ``temperature`` (0) and the task stream (name,
  source, templates, system prompt, components, shuffle and its seed); ``segments``, one per run
  of the command: the first line it wrote (``start``), ``task_offset`` / ``task_limit``,
  ``batch_size`` (``trace.batch_size``: prompts decoded together, :func:`greedy_batch`), git hash +
  dirty flag, CPU.
- ``trace.jsonl``, one line per prompt turn, appended (write + flush + fsync) as each finishes:
  ``index`` (the record's position in the task's stream: ``task.offset`` + its place in the run),
  ``turn``, ``id`` (the record id), ``task``, ``prompt_ids``, ``output_ids`` (EOS included when
  reached), ``stop`` (``eos`` or ``length``), ``wall_s`` (seconds of the generation, not part of the
  trace's identity) and ``sha256``, the checksum of the line's other fields, so a corrupt line is
  detected on read; a line without its newline is one cut while being written.

Running the command again with the same overrides continues the trace: prompts already in it are
skipped, a half-written last line is dropped and redone, a larger ``task.limit`` (or another
``task.offset``) adds the prompts not yet traced; a config that changes the identity is refused.
The run directory (``hydra.run.dir``, the trace directory by default) gets the usual
``config.yaml``, ``provenance.json``, ``metrics.jsonl`` (one timing row per line) and ``summary.json``
(:class:`omnidraft.lifecycle.RunContext`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from omnidraft.config import check_schema, task_templates
from omnidraft.core import kv
from omnidraft.core.decode import generate
from omnidraft.data.models import load_model, sliding_window
from omnidraft.data.tasks import Record, format_prompt, load_stream, render
from omnidraft.drafting.direct_map import tokenizer_hash
from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import (
    RunContext,
    command_overrides,
    overrides_in,
    resolve_dtypes,
    to_plain,
    without_archive_pins,
    write_json,
)

FORMAT = 1
META_FILE = "meta.json"
LINES_FILE = "trace.jsonl"
# identity keys known only once the target's tokenizer has loaded
_LOADED_KEYS = ("tokenizer_hash", "chat_template_sha256")
_TARGET_KEYS = ("name", "source", "hub_id", "revision", "path", "gguf", "tiny", "dtype", "device",
                "trust_remote_code", "chat_template")
_TASK_KEYS = ("name", "source", "path", "split", "on_bad_record", "system_prompt", "components",
              "switch_at", "shuffle")
# the config groups whose overrides decide a trace (the command that makes one keeps only these)
_TRACE_GROUPS = ("target", "task", "decode", "seed", "paths", "trace", "debug", "experiment", "scale", "pair")


@dataclass
class TraceLine:
    """The target's greedy output for one turn of one prompt.

    Attributes:
        index: the record's position in the task's stream (``task.offset`` + its place in the run).
        turn: the turn (0, or 1 for MT-Bench's second turn, sent with the first answer).
        id: the record id.
        task: the record's task (a component's name in mix / switch streams).
        prompt_ids: the prompt in target ids, chat template applied.
        output_ids: the greedy output, EOS included when it was reached.
        stop: ``eos`` or ``length`` (``max_new_tokens`` reached).
        wall_s: seconds the generation took (prefill included); not part of the trace's identity.
    """

    index: int
    turn: int
    id: str
    task: str
    prompt_ids: list[int]
    output_ids: list[int]
    stop: str
    wall_s: float


@dataclass
class Trace:
    """A target trace as read from disk (see the module docstring for the files).

    Attributes:
        path: the trace directory.
        meta: ``meta.json``: ``format``, ``identity``, ``segments``.
        lines: every line of ``trace.jsonl``, in file order.
        by_key: the lines by ``(index, turn)``.
    """

    path: Path
    meta: dict[str, Any]
    lines: list[TraceLine] = field(default_factory=list)
    by_key: dict[tuple[int, int], TraceLine] = field(default_factory=dict)

    @property
    def identity(self) -> dict[str, Any]:
        return self.meta["identity"]

    @property
    def max_new_tokens(self) -> int:
        return int(self.identity["max_new_tokens"])

    def get(self, index: int, turn: int = 0) -> TraceLine | None:
        """The line of record ``index``'s ``turn``, or None when the trace lacks it."""
        return self.by_key.get((index, turn))


@dataclass(frozen=True)
class PromptRef:
    """One record a replay needs from a trace.

    Attributes:
        index: its position in the task's stream (``task.offset`` + its place in the run).
        id: its record id.
        turns: how many turns it has (each must be in the trace).
        prompt_ids: its first turn's prompt in target ids, when the caller has it (compared with
            the trace's: catches another template, system prompt or chat template).
    """

    index: int
    id: str
    turns: int = 1
    prompt_ids: tuple[int, ...] | None = None


@dataclass
class TraceRequest:
    """What a run that replays a trace needs it to match (:func:`check_trace`).

    Attributes:
        tokenizer_hash: the run's target tokenizer (:func:`omnidraft.drafting.direct_map.tokenizer_hash`).
        dtype: the run's target dtype, ``auto`` resolved.
        chat_template: the run's ``target.chat_template``.
        max_new_tokens: the run's ``decode.max_new_tokens``; the trace must hold at least as many.
        prompts: the records the run decodes.
        command: the ``omnidraft trace`` command that makes this run's trace (:func:`trace_command`).
        task: the run's task stream as in a trace's identity (:func:`trace_identity`), or None to
            skip that comparison.
    """

    tokenizer_hash: str
    dtype: str
    chat_template: bool
    max_new_tokens: int
    prompts: list[PromptRef]
    command: str
    task: dict[str, Any] | None = None


def check_trace_config(cfg: DictConfig) -> None:
    """Everything ``omnidraft trace`` can check before a model loads.

    Raises:
        OmniDraftError: a schema violation, or sampling (``method.temperature > 0``: a sampled
            stream has no single trajectory to record).
    """
    check_schema(cfg)
    temp = float(cfg.method.temperature)
    if temp > 0:
        raise OmniDraftError(f"omnidraft trace records the target's greedy output; method.temperature={temp:g} "
                             "has no single trajectory to record: drop method.temperature (the trace "
                             "ignores the method otherwise)")


def trace_dir(cfg: DictConfig) -> Path:
    """The trace directory of a config: ``trace.out_dir``, or by default
    ``<paths.results_dir>/traces/<target.name>/<task.name>``."""
    node = cfg.get("trace")
    out = node.get("out_dir") if node is not None else None
    if out:
        return Path(out)
    return Path(cfg.paths.results_dir) / "traces" / str(cfg.target.name) / str(cfg.task.name)


def trace_identity(cfg: DictConfig) -> dict[str, Any]:
    """What every line of a trace depends on, from the config (``dtype: auto`` must be resolved,
    :func:`omnidraft.lifecycle.resolve_dtypes`); :func:`tokenizer_facts` adds the loaded
    tokenizer's. Which prompts (``task.offset``, ``task.limit``) is not part of it: a trace grows.

    Args:
        cfg: the run's config.

    Returns:
        ``{"target": {...}, "max_new_tokens", "temperature", "task": {...}}``.
    """
    target, task = to_plain(cfg.target), to_plain(cfg.task)
    t = {k: task.get(k) for k in _TASK_KEYS}
    if task.get("path"):  # a local file is known by its content: the same file under another path is the same stream
        t["path_sha256"] = file_sha256(Path(str(task["path"])))
    t["templates"] = task_templates(cfg.task)
    t["seed"] = int(cfg.seed) if task.get("shuffle") else None  # the seed orders a shuffled stream only
    return {"target": without_archive_pins({k: target.get(k) for k in _TARGET_KEYS}),
            "max_new_tokens": int(cfg.decode.max_new_tokens), "temperature": 0.0, "task": t}


def tokenizer_facts(tokenizer, use_chat_template: bool) -> dict[str, Any]:
    """The identity keys of a loaded target tokenizer.

    Args:
        tokenizer: the target's tokenizer.
        use_chat_template: ``target.chat_template``.

    Returns:
        ``tokenizer_hash`` (vocabulary and special tokens) and ``chat_template_sha256`` (of the
        template applied to prompts; None when none is).
    """
    tpl = getattr(tokenizer, "chat_template", None) if use_chat_template else None
    text = tpl if isinstance(tpl, str) or tpl is None else json.dumps(tpl, sort_keys=True)
    return {"tokenizer_hash": tokenizer_hash(tokenizer),
            "chat_template_sha256": hashlib.sha256(text.encode()).hexdigest() if text else None}


def trace_command(cfg: DictConfig) -> str:
    """The ``omnidraft trace`` command that makes (or completes) the trace of a run's prompts: the
    run's overrides of the groups a trace depends on (target, task, decode, seed, paths, trace,
    debug, experiment, scale, pair), method and drafter ones left out."""
    keep = overrides_in(cfg, _TRACE_GROUPS)
    return " ".join(["omnidraft trace", *(shlex.quote(o) for o in keep)])


def request_for(cfg: DictConfig, tokenizer, records: Sequence[Record],
                first_prompt_ids: Sequence[Sequence[int]] | None = None) -> TraceRequest:
    """What a run of ``cfg`` over ``records`` needs from a trace.

    Args:
        cfg: the run's config (dtypes resolved).
        tokenizer: the run's target tokenizer.
        records: the run's prompt stream (:func:`omnidraft.data.tasks.load_stream`).
        first_prompt_ids: each record's first-turn prompt in target ids, when already computed.

    Returns:
        The request for :func:`check_trace`.
    """
    off = int(cfg.task.offset)
    prompts = [PromptRef(off + i, r.id, len(r.turns),
                         tuple(first_prompt_ids[i]) if first_prompt_ids is not None else None)
               for i, r in enumerate(records)]
    return TraceRequest(tokenizer_hash=tokenizer_hash(tokenizer), dtype=str(cfg.target.dtype),
                        chat_template=bool(cfg.target.chat_template),
                        max_new_tokens=int(cfg.decode.max_new_tokens), prompts=prompts,
                        command=trace_command(cfg), task=trace_identity(cfg)["task"])


def check_trace(trace: Trace, want: TraceRequest) -> None:
    """Refuse a trace that cannot stand in for the target of a run.

    The trace must come from a target with the same tokenizer, dtype and chat-template setting,
    hold at least ``max_new_tokens`` new tokens per prompt (a trace made with more is fine: a
    replay stops earlier; not for multi-turn records, whose later prompts hold the earlier
    answers: they need the trace's own length), come from the same task stream, and hold every turn of every record
    asked for, under the same record id (and prompt, where given).

    Args:
        trace: from :func:`read_trace`.
        want: from :func:`request_for`.

    Raises:
        OmniDraftError: the first mismatch, on one line; missing prompts are named, with the
            command that makes them.
    """
    where, ident = f"trace {trace.path}", trace.identity
    tgt = ident["target"]
    if tgt.get("tokenizer_hash") != want.tokenizer_hash:
        raise OmniDraftError(f"{where} was made with another target tokenizer (hash "
                             f"{str(tgt.get('tokenizer_hash'))[:12]}, this run's target: {want.tokenizer_hash[:12]}); "
                             f"make this target's trace: {want.command}")
    if tgt.get("dtype") != want.dtype:
        raise OmniDraftError(f"{where} was decoded in {tgt.get('dtype')}, this run's target runs {want.dtype} "
                             f"(greedy outputs differ across dtypes): pass target.dtype={tgt.get('dtype')} or make "
                             f"a {want.dtype} trace in another trace.out_dir: {want.command}")
    if bool(tgt.get("chat_template")) != want.chat_template:
        raise OmniDraftError(f"{where} was made with target.chat_template={bool(tgt.get('chat_template'))}, this run "
                             f"uses {want.chat_template}; pass target.chat_template={bool(tgt.get('chat_template'))}")
    if trace.max_new_tokens < want.max_new_tokens:
        raise OmniDraftError(f"{where} holds at most {trace.max_new_tokens} new tokens per prompt, this run asks "
                             f"decode.max_new_tokens={want.max_new_tokens}: lower it, or make a longer trace in "
                             f"another trace.out_dir: {want.command}")
    if trace.max_new_tokens != want.max_new_tokens and any(p.turns > 1 for p in want.prompts):
        raise OmniDraftError(f"{where} holds {trace.max_new_tokens} new tokens per turn and this run asks "
                             f"decode.max_new_tokens={want.max_new_tokens}: a later turn's prompt holds the earlier "
                             f"answer, so multi-turn prompts replay only at the trace's length; pass "
                             f"decode.max_new_tokens={trace.max_new_tokens} or make a trace of this length in "
                             f"another trace.out_dir: {want.command}")
    if want.task is not None:
        d = _first_difference(*_task_as_compared(ident["task"], want.task), "task.")
        if d:
            raise OmniDraftError(f"{where} is of another task stream ({d}); make this run's trace: {want.command}")
    missing = []
    for p in want.prompts:
        line = trace.get(p.index)
        if line is not None and line.id != p.id:
            raise OmniDraftError(f"{where} holds record {line.id!r} at stream index {p.index}, this run's stream "
                                 f"has {p.id!r} there: another task stream; make this run's trace: {want.command}")
        if line is not None and p.prompt_ids is not None and tuple(line.prompt_ids) != tuple(p.prompt_ids):
            raise OmniDraftError(f"{where}: the prompt of record {p.id!r} (index {p.index}) differs from this run's "
                                 f"(template, system prompt or chat template); make this run's trace: {want.command}")
        if any(trace.get(p.index, turn) is None for turn in range(p.turns)):
            missing.append(p)
    if missing:
        named = ", ".join(f"{p.index} {p.id!r}" for p in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise OmniDraftError(f"{where} lacks {len(missing)} of this run's {len(want.prompts)} prompts (index "
                             f"{named}); make them with: {want.command}")


def read_trace(path: str | Path) -> Trace:
    """Read a trace, refusing any damage.

    Args:
        path: the trace directory (or its ``trace.jsonl``).

    Returns:
        The trace.

    Raises:
        OmniDraftError: no trace there, an unreadable ``meta.json``, or the first truncated, corrupt
            (unparseable, checksum mismatch) or duplicated line, named ``<file>:<line>``.
    """
    d = Path(path)
    if d.name == LINES_FILE:
        d = d.parent
    meta = _read_meta(d)
    if meta is None:
        raise OmniDraftError(f"no trace in {d} ({META_FILE} missing); make one with `omnidraft trace`")
    lines, _ = _scan(d / LINES_FILE, tail_ok=False)
    return Trace(d, meta, lines, {(ln.index, ln.turn): ln for ln in lines})


def compare_traces(a: Trace, b: Trace) -> dict[str, Any]:
    """How two traces of the same prompts agree, line by line (another batch size, dtype, thread
    count or machine: greedy decoding is deterministic up to float rounding, so they differ only
    after a near-tie).

    Args:
        a: one trace (e.g. decoded one prompt at a time).
        b: the other; only the lines both hold are compared.

    Returns:
        ``lines`` compared, ``identical_lines`` and their share, ``tokens`` (of ``a``'s outputs),
        ``tokens_before_first_difference`` summed over lines and its share, ``differing``: per
        differing line its ``index``, ``turn`` and ``first_difference_at`` (output position), and
        per trace its ``path``, ``dtype`` and the ``batch_sizes`` of the runs that wrote the compared
        lines (``meta.json``'s segments).

    Raises:
        OmniDraftError: no line in common, or a line whose prompts differ (traces of another stream).
    """
    keys = sorted(set(a.by_key) & set(b.by_key))
    if not keys:
        raise OmniDraftError(f"{a.path} and {b.path} hold no prompt in common (index, turn): trace the same "
                             "task.offset / task.limit into both")
    same = toks = agree = 0
    differing: list[dict[str, int]] = []
    for key in keys:
        x, y = a.by_key[key], b.by_key[key]
        if x.prompt_ids != y.prompt_ids:
            raise OmniDraftError(f"index {key[0]} turn {key[1]}: the two traces hold different prompts ({a.path}, "
                                 f"{b.path}): they trace other streams or templates")
        n = 0
        while n < min(len(x.output_ids), len(y.output_ids)) and x.output_ids[n] == y.output_ids[n]:
            n += 1
        toks, agree = toks + len(x.output_ids), agree + n
        if x.output_ids == y.output_ids:
            same += 1
        else:
            differing.append({"index": key[0], "turn": key[1], "first_difference_at": n})

    def about(t: Trace) -> dict[str, Any]:  # the batch sizes of the runs that wrote the compared lines
        segs = [(int(g.get("start", 0)), int(g.get("batch_size", 1))) for g in t.meta.get("segments", [])]
        wrote = {(ln.index, ln.turn): ([b for at, b in segs if at <= n] or [1])[-1]  # the last run to start by then
                 for n, ln in enumerate(t.lines)}
        return {"path": str(t.path), "dtype": t.identity["target"].get("dtype"),
                "batch_sizes": sorted({wrote[k] for k in keys})}

    return {"lines": len(keys), "identical_lines": same, "identical_share": same / len(keys), "tokens": toks,
            "tokens_before_first_difference": agree, "token_share": agree / toks if toks else 1.0,
            "differing": differing, "a": about(a), "b": about(b)}


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _line_text(line: TraceLine) -> str:
    """One JSONL line (no newline): the line's fields and their checksum."""
    body = asdict(line)
    return json.dumps({**body, "sha256": _digest(body)}, separators=(",", ":"))


def _parse_line(raw: bytes, where: str) -> TraceLine:
    try:
        obj = json.loads(raw)
        sha = obj.pop("sha256")
        ok = sha == _digest(obj)
        line = TraceLine(**obj)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise OmniDraftError(f"{where}: corrupt trace line ({type(e).__name__}: {str(e)[:80]}); delete it and "
                             "the lines after it, then run the same `omnidraft trace` command again") from None
    if not ok:
        raise OmniDraftError(f"{where}: corrupt trace line (checksum mismatch); delete it and the lines after it, "
                             "then run the same `omnidraft trace` command again")
    return line


def _scan(file: Path, *, tail_ok: bool) -> tuple[list[TraceLine], int]:
    """The lines of ``trace.jsonl`` and the byte length of its complete ones.

    Args:
        file: the trace.jsonl (absent: no lines).
        tail_ok: a last line without its newline (cut while it was written) is left out instead of
            refused (the command redoes it).
    """
    data = file.read_bytes() if file.exists() else b""
    parts = data.split(b"\n")
    lines: list[TraceLine] = []
    first_at: dict[tuple[int, int], int] = {}
    good = 0
    for n, raw in enumerate(parts, 1):
        if n == len(parts):  # after the last newline: empty, or a line cut while being written
            if raw and not tail_ok:
                raise OmniDraftError(f"{file}:{n}: truncated trace line (no newline: the trace was cut while "
                                     "writing it); run the same `omnidraft trace` command again to redo it")
            break
        line = _parse_line(raw, f"{file}:{n}")
        key = (line.index, line.turn)
        if key in first_at:
            raise OmniDraftError(f"{file}:{n}: duplicate trace line for index {line.index} turn {line.turn} "
                                 f"(first at line {first_at[key]})")
        first_at[key] = n
        lines.append(line)
        good += len(raw) + 1
    return lines, good


def _read_meta(d: Path) -> dict[str, Any] | None:
    p = d / META_FILE
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
        ok = isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("identity"), dict)
    except ValueError as e:
        raise OmniDraftError(f"{p}: unreadable trace metadata ({e}); delete the trace directory and trace again") from None
    if not ok:
        raise OmniDraftError(f"{p}: not a format-{FORMAT} trace; delete the trace directory and trace again")
    return meta


def file_sha256(path: Path) -> str | None:
    """The file's sha256 (None when there is no such file: loading the task says so)."""
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _task_as_compared(saved: dict[str, Any], now: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A local task file is compared by its content (``path_sha256``) where both identities hold it,
    not by the path string; a trace saved before the hash was recorded compares by path."""
    if "path_sha256" in saved and "path_sha256" in now:
        return ({k: v for k, v in saved.items() if k != "path"}, {k: v for k, v in now.items() if k != "path"})
    return ({k: v for k, v in saved.items() if k != "path_sha256"}, {k: v for k, v in now.items() if k != "path_sha256"})


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first key where the saved ``a`` and the current ``b`` differ, as ``key: saved x, now y``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if d:
                return d
        return None
    return None if a == b else f"{prefix.rstrip('.')}: saved {a!r}, now {b!r}"


def _without_loaded(identity: dict[str, Any]) -> dict[str, Any]:
    return {**identity, "target": {k: v for k, v in identity["target"].items() if k not in _LOADED_KEYS}}


def _refuse_changed(d: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    saved_task, now_task = _task_as_compared(saved.get("task") or {}, now.get("task") or {})
    diff = _first_difference({**saved, "task": saved_task}, {**now, "task": now_task})
    if diff:
        raise OmniDraftError(f"cannot continue the trace in {d}: the config differs ({diff}); re-run with the "
                             f"trace's overrides, or trace into another trace.out_dir (or delete {d})")


def _check_context(lm, rid: str, n_prompt: int, max_new: int) -> None:
    need = n_prompt + max_new
    if need > lm.max_context:
        raise OmniDraftError(f"prompt {rid!r} has {n_prompt} tokens; with decode.max_new_tokens={max_new} it exceeds "
                             f"the target {lm.name}'s context of {lm.max_context}; lower decode.max_new_tokens or "
                             "drop the prompt (task.offset/limit)")
    window = sliding_window(lm.model.config)
    if window is not None and need > window:
        raise OmniDraftError(f"prompt {rid!r} needs {need} positions but the target {lm.name} uses sliding-window "
                             f"attention over {window}; lower decode.max_new_tokens or use shorter prompts")


@torch.no_grad()
def greedy_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: set[int] | frozenset,
                 pad_id: int = 0) -> list[tuple[list[int], str]]:
    """The greedy continuations of several prompts, decoded together (one forward per token for the
    whole batch).

    Decoding a target on a CPU (or a large GPU) is bound by reading its weights more than by
    arithmetic, so a batch of b prompts costs far less per token than b prompts one by one (b=16:
    ~6x the tokens/s on one Xeon core, LOG.md session 31). The prompts are left-padded
    to one length; padded positions are masked out and every prompt's positions count from 0, so
    each row computes what it would alone, up to float rounding (other matmul shapes): an argmax
    changes only where two logits tie to within rounding. A row that has ended keeps being fed
    (its further output is dropped) until every row has ended.

    Args:
        model: a causal LM (transformers: ``attention_mask``, ``position_ids``, ``cache``).
        prompts: the prompts in target ids, chat template applied, each of length >= 1.
        max_new_tokens: tokens to decode per prompt at most.
        eos_ids: tokens that end a prompt's output (kept in it).
        pad_id: the id put in padded positions (masked: any id).

    Returns:
        Per prompt, in order: its output ids (EOS included when reached) and ``eos`` or ``length``.
    """
    assert prompts and all(prompts), "empty prompt"
    b, width = len(prompts), max(len(p) for p in prompts)
    dev = model.device
    ids = torch.full((b, width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = kv.new_cache(model)
    mask = mask.to(dev)
    logits = model(input_ids=ids.to(dev), attention_mask=mask, position_ids=pos.to(dev), cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    nxt_pos = pos[:, -1:].to(dev) + 1
    outs: list[list[int]] = [[] for _ in range(b)]
    stops: list[str | None] = [None] * b
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1)
        for r, t in enumerate(nxt.tolist()):
            if stops[r] is None:
                outs[r].append(int(t))
                if t in eos_ids:
                    stops[r] = "eos"
                elif len(outs[r]) >= max_new_tokens:
                    stops[r] = "length"
        if all(s is not None for s in stops):
            break
        mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=nxt_pos, cache=cache,
                       use_cache=True).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return list(zip(outs, stops))  # every row has stopped: the loop ends at max_new_tokens


def _row(line: TraceLine) -> dict[str, Any]:
    """The metrics.jsonl row of one line."""
    n = len(line.output_ids)
    return {"prompt/id": line.id, "prompt/index": line.index, "prompt/turn": line.turn, "task": line.task,
            "prompt/tokens": len(line.prompt_ids), "trace/new_tokens": n, "trace/stop": line.stop,
            "trace/wall_s": line.wall_s, "speed/tok_per_s": n / line.wall_s if line.wall_s > 0 else None}


def run_trace(cfg: DictConfig) -> dict[str, Any]:
    """Trace the target's greedy decoding of the task's prompts into :func:`trace_dir`.

    Prompts already in the trace are skipped (a half-written last line is redone), so running it
    again continues a cut trace or extends it to more prompts.

    Args:
        cfg: a ``conf/trace.yaml`` config (the method is ignored; it must not sample).

    Returns:
        The summary (also ``run_dir/summary.json``): lines in the trace, lines added by this run,
        their tokens and tokens/s, provenance.

    Raises:
        OmniDraftError: sampling asked for, a config that differs from the existing trace's, a
            damaged trace (other than a half-written last line), a prompt too long for the target.
    """
    check_trace_config(cfg)
    resolve_dtypes(cfg)
    out = trace_dir(cfg)
    lines_path = out / LINES_FILE
    ident = trace_identity(cfg)
    saved = _read_meta(out)
    if saved is not None:  # before any model loads
        _refuse_changed(out, _without_loaded(saved["identity"]), ident)
    elif lines_path.exists():
        raise OmniDraftError(f"{lines_path} exists without its {META_FILE}; delete it or use another trace.out_dir")
    t_load = time.perf_counter()
    cache = Path(cfg.paths.cache_dir)
    target = load_model(to_plain(cfg.target), cache)
    ident["target"].update(tokenizer_facts(target.tokenizer, bool(cfg.target.chat_template)))
    if saved is not None:
        _refuse_changed(out, saved["identity"], ident)
    t = cfg.task
    records = load_stream(to_plain(t), cache, seed=int(cfg.seed))
    load_s = time.perf_counter() - t_load
    done, good = _scan(lines_path, tail_ok=True)
    line_no = {(ln.index, ln.turn): n for n, ln in enumerate(done, 1)}
    have = {(ln.index, ln.turn): ln for ln in done}

    tok, n_new, off = target.tokenizer, int(cfg.decode.max_new_tokens), int(t.offset)
    templates = task_templates(t)

    def prompt_ids(text: str | list[dict[str, str]]) -> list[int]:  # as Session.prompt_ids
        return format_prompt(tok, text, system=t.system_prompt, use_chat_template=cfg.target.chat_template)

    first = [prompt_ids(render(r, 0, templates)) for r in records]
    for i, r in enumerate(records):
        line = have.get((off + i, 0))
        if line is not None and (line.id != r.id or line.prompt_ids != first[i]):
            raise OmniDraftError(f"{lines_path}:{line_no[(off + i, 0)]} holds record {line.id!r} at stream index "
                                 f"{off + i}, but this config's stream has {r.id!r} there (or another prompt): the "
                                 f"task data changed; trace into another trace.out_dir (or delete {out})")
        _check_context(target, r.id, len(first[i]), n_new)

    todo = [i for i, r in enumerate(records) if any((off + i, k) not in have for k in range(len(r.turns)))]
    if saved is not None and not todo and lines_path.exists() and lines_path.stat().st_size == good \
            and saved["identity"] == ident:
        # complete, its identity current: nothing is written (no empty segment in meta.json, the last run's
        # summary and rows kept; by default the run directory is the trace's). An identity to refresh (a key
        # newer code records, a moved task file) goes the usual way and is rewritten.
        print(f"omnidraft: trace: {out} already holds all {len(records)} prompts of this stream; nothing to add",
              file=sys.stderr)
        return {"status": "ok", "trace_dir": str(out), "n_lines": len(done), "n_added": 0, "n_records": len(records),
                "resumed_at": len(done), "complete": True}

    ctx = RunContext(cfg, command_overrides(cfg))
    if saved is not None:
        if lines_path.exists() and lines_path.stat().st_size > good:
            with open(lines_path, "r+b") as f:  # the half-written last line goes; it is redone
                f.truncate(good)
        ctx.resume(len(done), saved.get("segments", []), ((n, _row(ln)) for n, ln in enumerate(done)))
    else:
        out.mkdir(parents=True, exist_ok=True)
        ctx.fresh()
    ctx.segments[-1].update({"task_offset": off, "task_limit": t.limit,
                             "batch_size": int(cfg.trace.batch_size)})
    write_json(out / META_FILE, {"format": FORMAT, "identity": ident, "segments": ctx.segments})
    log = ctx.open_log(sinks=False)
    added: list[TraceLine] = []

    def summary_of(status: str) -> dict[str, Any]:
        toks = sum(len(ln.output_ids) for ln in added)
        secs = sum(ln.wall_s for ln in added)
        return {"status": status, "trace_dir": str(out), "n_lines": len(done) + len(added),
                "n_added": len(added), "n_records": len(records), "target": cfg.target.name,
                "dtype": str(cfg.target.dtype), "task": t.name, "task_offset": off, "task_limit": t.limit,
                "max_new_tokens": n_new, "trace/new_tokens": toks,
                "trace/eos_share": sum(ln.stop == "eos" for ln in added) / len(added) if added else None,
                "speed/tok_per_s": toks / secs if secs > 0 else None, "time/load_s": load_s,
                "resumed_at": ctx.resumed_at, "provenance": ctx.prov}

    complete = sum(all((off + i, k) in have for k in range(len(r.turns))) for i, r in enumerate(records))
    with ctx.finishing(summary_of), open(lines_path, "a", encoding="utf-8") as f:
        for i in todo[: int(cfg.warmup_prompts)]:  # warm-up (allocator, kernels): not recorded
            generate(target.model, first[i], drafter=None, max_new_tokens=16, eos_ids=target.eos_ids)
        bar = tqdm(total=len(records), initial=complete, desc=f"trace {cfg.target.name} {t.name}", unit="prompt",
                   disable=not cfg.progress, dynamic_ncols=True)

        def record(i: int, turn: int, ids: list[int], tokens: list[int], stop: str, wall_s: float) -> TraceLine:
            r = records[i]
            line = TraceLine(index=off + i, turn=turn, id=r.id, task=r.metadata.get("task", t.name),
                             prompt_ids=list(ids), output_ids=list(tokens), stop=stop, wall_s=wall_s)
            f.write(_line_text(line) + "\n")  # whole lines only: a crash leaves at most a cut tail
            f.flush()
            os.fsync(f.fileno())
            added.append(line)
            log.log(_row(line), step=len(done) + len(added) - 1)
            return line

        def advance() -> None:
            bar.update(1)
            toks, secs = sum(len(ln.output_ids) for ln in added), sum(ln.wall_s for ln in added)
            bar.set_postfix({"tok/s": f"{toks / secs:.1f}" if secs > 0 else "-"})

        batch = int(cfg.trace.batch_size)
        if batch > 1:  # first turns together, grouped by prompt length (less padding); lines land as batches end
            single = [i for i in todo if (off + i, 0) not in have]
            single.sort(key=lambda i: len(first[i]))
            for at in range(0, len(single), batch):
                group = single[at: at + batch]
                t0 = time.perf_counter()
                outs = greedy_batch(target.model, [first[i] for i in group], n_new, target.eos_ids)
                share = (time.perf_counter() - t0) / len(group)  # each line's share of the batch's time
                for i, (tokens, stop) in sorted(zip(group, outs)):
                    have[(off + i, 0)] = record(i, 0, first[i], tokens, stop, share)
                    if len(records[i].turns) == 1:
                        advance()
            todo = [i for i in todo if len(records[i].turns) > 1]  # their later turns, one by one below
        for i in todo:
            r = records[i]
            history: list[dict[str, str]] = []
            for turn in range(len(r.turns)):
                history.append({"role": "user", "content": render(r, turn, templates)})
                ids = first[i] if turn == 0 else prompt_ids(history)
                line = have.get((off + i, turn))
                if line is None:
                    if turn:
                        _check_context(target, f"{r.id} turn {turn + 1}", len(ids), n_new)
                    res = generate(target.model, ids, drafter=None, max_new_tokens=n_new,
                                   eos_ids=target.eos_ids, temperature=0.0)
                    line = record(i, turn, ids, res.tokens, res.stop, res.wall_s)
                elif line.prompt_ids != ids:  # a later turn already traced, its history rebuilt
                    raise OmniDraftError(f"{lines_path}:{line_no[(off + i, turn)]}: the traced prompt of record "
                                         f"{r.id!r} turn {turn + 1} differs from this config's; trace into another "
                                         f"trace.out_dir (or delete {out})")
                # the next turn is sent with this answer, as the stream runner does
                history.append({"role": "assistant", "content": tok.decode(line.output_ids, skip_special_tokens=True)})
            advance()
        bar.close()
    return ctx.summary
