"""``omnidraft calibrate``: this machine's forward latency of the target and the drafter.

A replay from a target trace (:class:`omnidraft.core.verifiers.TraceVerifier`) gives acceptance
without running the target, so its speed can only be modelled: from how long the target's and the
drafter's forwards take on the machine, as a function of the new tokens each forward feeds. This
command measures that once per machine, model pair, dtype and thread count, and a replay run reads
it back (:func:`load_calibration`, :func:`check_calibration`) to report ``speed/modelled_speedup``
(:func:`modelled_speedup`).

Each model is prefilled with a cached context of ``calibrate.context_tokens`` random token ids
(seeded by ``seed``); then every forward feeds ``n`` new ids after it, for each ``n`` in
``calibrate.tokens_per_forward``, and the cache is cropped back to the context before the next one,
as the decode loop runs them (:mod:`omnidraft.core.kv`):

- ``target``: ``kv.forward`` with the logits of every position (the verifier's forward: the
  pending token plus the drafts);
- ``drafter``: ``kv.forward`` with the last position's logits only (drafting);
- ``drafter_hidden``: ``kv.forward_hidden``, the drafter's forward with its last hidden state (how
  it drafts when the acceptance head decides the draft length).

``calibrate.warmup`` untimed rounds come first, then ``calibrate.repeats`` timed rounds; a round
times one forward of every ``n`` in turn, so slow drift of the machine spreads over all ``n``. On
CUDA the device is synchronised before and after each forward. Each ``n`` gets the median, min and
max seconds.

The file, by default ``<paths.results_dir>/calibration/<target>-<drafter>/<machine>_<dtype>_<threads>t.json``
(``<machine>``: the GPU's name where the target runs on CUDA, else the CPU's, as a slug;
``calibrate.out`` overrides the path), is written atomically and holds::

    {"format": 1, "kind": "omnidraft-latency-calibration", "machine": "<slug>",
     "context_tokens": 256, "repeats": 7, "warmup": 2, "tokens_per_forward": [1, 2, ...],
     "models": {
       "target":  {"name", "source", "dtype", "device", "threads",
                   "forward": {"1": {"median_s", "min_s", "max_s"}, ...}},
       "drafter": {..., "forward": {...}, "forward_hidden": {...}}},
     "provenance": {git hash + dirty flag, package versions, CPU with its ISA, GPU, threads, ...}}

with a Markdown table of the medians beside it (same name, ``.md``). The run directory
(``hydra.run.dir``: ``.../runs/<date>_<time>`` beside the file) gets the usual ``config.yaml``,
``provenance.json``, ``metrics.jsonl`` (one row per model and ``n``) and ``summary.json``
(:class:`omnidraft.lifecycle.RunContext`). Running the command again recalibrates (the file is
replaced).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from omnidraft import tables
from omnidraft.config import check_schema
from omnidraft.core import kv
from omnidraft.data.models import LoadedModel, load_model, sliding_window
from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import RunContext, command_overrides, resolve_dtypes, to_plain, write_json
from omnidraft.provenance import cpu_flags

FORMAT = 1
KIND = "omnidraft-latency-calibration"
ROLES = ("target", "drafter")


@dataclass(frozen=True)
class Timing:
    """Seconds of one forward feeding ``n`` new tokens, over the timed repeats.

    Attributes:
        median_s: the median.
        min_s: the fastest repeat.
        max_s: the slowest repeat.
    """

    median_s: float
    min_s: float
    max_s: float


@dataclass
class ModelLatency:
    """One model's calibrated forwards.

    Attributes:
        name: the model's config name (``target.name`` / ``drafter.name``).
        dtype: the dtype it ran in (``auto`` resolved).
        device: the device it ran on.
        threads: torch's CPU threads during the measurement.
        tables: ``{"forward": {n: Timing}}`` (the drafter also ``"forward_hidden"``).
        source: the model's config source (hub, gguf_package, local, tiny).
    """

    name: str
    dtype: str
    device: str
    threads: int
    tables: dict[str, dict[int, Timing]] = field(default_factory=dict)
    source: str | None = None

    def seconds(self, n: int, table: str = "forward", extrapolate: bool = False) -> float:
        """The median seconds of a forward of ``n`` new tokens, linear between measured ``n``.

        Args:
            n: new tokens fed by the forward (>= 1).
            table: ``forward``, or ``forward_hidden`` (drafter: with its last hidden state).
            extrapolate: beyond the largest measured ``n``, scale its median by ``n / n_max``
                instead of refusing.

        Returns:
            The measured median at a measured ``n``; between two measured ``n`` the linear
            interpolation of their medians.

        Raises:
            OmniDraftError: ``n`` outside the measured range (above it only without
                ``extrapolate``), or a table this model lacks.
        """
        t = self.tables.get(table)
        if not t:
            raise OmniDraftError(f"the calibration of {self.name} has no {table!r} table; "
                                 "recalibrate with `omnidraft calibrate`")
        ns = sorted(t)
        if n in t:
            return t[n].median_s
        if extrapolate and n > ns[-1]:
            return t[ns[-1]].median_s * n / ns[-1]
        if n > ns[-1] or n < ns[0]:
            side = f"beyond the largest calibrated n={ns[-1]}" if n > ns[-1] else \
                f"below the smallest calibrated n={ns[0]}"
            raise OmniDraftError(f"{self.name}: a forward of n={n} tokens is {side}; recalibrate with "
                                 f"calibrate.tokens_per_forward covering {n}")
        hi = next(i for i, m in enumerate(ns) if m > n)
        a, b = ns[hi - 1], ns[hi]
        ya, yb = t[a].median_s, t[b].median_s
        return ya + (yb - ya) * (n - a) / (b - a)


@dataclass
class Calibration:
    """A latency calibration as read from disk (see the module docstring for the file).

    Attributes:
        target: the target's forwards.
        drafter: the drafter's forwards (``forward`` and ``forward_hidden``).
        context_tokens: the cached prefix each forward continued.
        repeats: timed forwards per ``n``.
        machine: the machine's slug (GPU or CPU name).
        provenance: git, versions, CPU with its ISA, GPU, threads.
        path: the file it was read from (None when built in memory).
    """

    target: ModelLatency
    drafter: ModelLatency
    context_tokens: int
    repeats: int
    machine: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    extrapolate: bool = False  # forwards longer than measured: scaled from the largest n (replay)

    def target_s(self, n: int) -> float:
        """Median seconds of a target forward (all logits) feeding ``n`` new tokens
        (:meth:`ModelLatency.seconds`)."""
        return self.target.seconds(n, extrapolate=self.extrapolate)

    def drafter_s(self, n: int, hidden: bool = False) -> float:
        """Median seconds of a drafter forward (last logits) feeding ``n`` new tokens; with
        ``hidden`` also returning its last hidden state (:meth:`ModelLatency.seconds`)."""
        return self.drafter.seconds(n, "forward_hidden" if hidden else "forward", extrapolate=self.extrapolate)


@dataclass(frozen=True)
class StepShape:
    """The forwards of one speculative step, what its latency is modelled from.

    Attributes:
        target_tokens: tokens the verifier's target forward fed: the pending token plus the
            proposed drafts (1 for a step with no draft).
        drafter_tokens: tokens fed by each drafter forward of the step, in order (the first one
            feeds what the last step emitted, the others one draft each); empty for drafters with
            no model (prompt lookup, the n-gram cache alone): their drafting costs nothing here.
        hidden: the drafter's forwards also returned hidden states (acceptance head).
    """

    target_tokens: int
    drafter_tokens: tuple[int, ...] = ()
    hidden: bool = False


def step_seconds(cal: Calibration, step: StepShape) -> float:
    """The modelled seconds of one step: its drafter forwards plus its target forward.

    Args:
        cal: the machine's calibration.
        step: what the step ran.

    Returns:
        ``sum(cal.drafter_s(n, step.hidden) for n in step.drafter_tokens) + cal.target_s(step.target_tokens)``.
    """
    return sum(cal.drafter_s(n, step.hidden) for n in step.drafter_tokens) + cal.target_s(step.target_tokens)


def modelled_speedup(cal: Calibration, steps: Sequence[StepShape], new_tokens: int) -> float:
    """``speed/modelled_speedup`` from a calibration: the paper / Medusa convention.

    Tokens per step over the relative step latency, where a speculative step costs its modelled
    forwards (:func:`step_seconds`, averaged over ``steps``) and a plain autoregressive step one
    one-token target forward (``cal.target_s(1)``). The formula is
    :func:`omnidraft.tables.modelled_speedup`, the one :func:`omnidraft.tables.summarise` applies
    to measured step times, so both give the same number for the same per-step latencies.

    Args:
        cal: the machine's calibration (:func:`load_calibration`, checked by :func:`check_calibration`).
        steps: every speculative step of the run (prefill excluded).
        new_tokens: the new target tokens those steps emitted.

    Returns:
        The modelled speedup over plain autoregressive decoding (0.0 without steps).

    Raises:
        OmniDraftError: a forward longer than the calibration measured.
    """
    if not steps:
        return 0.0
    sd_step = sum(step_seconds(cal, s) for s in steps) / len(steps)
    return tables.modelled_speedup(new_tokens / len(steps), sd_step, cal.target_s(1))


# --------------------------------------------------------------------------------------- reading


def calibrate_command(target_name: str, drafter_name: str, dtype: str, drafter_dtype: str | None = None) -> str:
    """The ``omnidraft calibrate`` command that makes a calibration for a pair and dtype(s)."""
    over = [f"target={target_name}", f"drafter={drafter_name}", f"target.dtype={dtype}"]
    if drafter_dtype is not None:
        over.append(f"drafter.dtype={drafter_dtype}")
    return " ".join(["omnidraft calibrate", *(shlex.quote(o) for o in over)])


def _timing(obj: Any) -> Timing:
    return Timing(float(obj["median_s"]), float(obj["min_s"]), float(obj["max_s"]))


def _model_latency(obj: dict[str, Any]) -> ModelLatency:
    tabs = {k: {int(n): _timing(t) for n, t in obj[k].items()} for k in ("forward", "forward_hidden") if k in obj}
    return ModelLatency(name=str(obj["name"]), dtype=str(obj["dtype"]), device=str(obj["device"]),
                        threads=int(obj["threads"]), tables=tabs, source=obj.get("source"))


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by ``omnidraft calibrate``.

    Args:
        path: the ``.json`` file.

    Returns:
        The calibration.

    Raises:
        OmniDraftError: no file there, or one that is not a readable format-1 calibration.
    """
    p = Path(path)
    if not p.is_file():
        raise OmniDraftError(f"no latency calibration at {p}; make one on this machine with `omnidraft calibrate` "
                             "(same target, drafter, dtype and threads)")
    try:
        obj = json.loads(p.read_text())
        if not isinstance(obj, dict) or obj.get("kind") != KIND or obj.get("format") != FORMAT:
            raise OmniDraftError(f"{p}: not a format-{FORMAT} latency calibration; make one with `omnidraft calibrate`")
        models = obj["models"]
        return Calibration(target=_model_latency(models["target"]), drafter=_model_latency(models["drafter"]),
                           context_tokens=int(obj["context_tokens"]), repeats=int(obj["repeats"]),
                           machine=str(obj.get("machine", "")), provenance=obj.get("provenance") or {}, path=p)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise OmniDraftError(f"{p}: unreadable latency calibration ({type(e).__name__}: {str(e)[:80]}); "
                             "make it again with `omnidraft calibrate`") from None


def check_calibration(cal: Calibration, target_name: str, drafter_name: str, dtype: str,
                      drafter_dtype: str | None = None) -> None:
    """Refuse a calibration made for another target, drafter or dtype.

    Args:
        cal: from :func:`load_calibration`.
        target_name: the run's ``target.name``.
        drafter_name: the run's ``drafter.name``.
        dtype: the run's target dtype (``auto`` resolved).
        drafter_dtype: the run's drafter dtype, when it is to be checked too.

    Raises:
        OmniDraftError: the first mismatch, on one line, with the command that makes the right one.
    """
    where = f"calibration {cal.path}" if cal.path is not None else "the calibration"
    make = calibrate_command(target_name, drafter_name, dtype, drafter_dtype)
    for role, want in (("target", target_name), ("drafter", drafter_name)):
        got = getattr(cal, role).name
        if got != want:
            raise OmniDraftError(f"{where} is of {role} {got!r}, this run's {role} is {want!r}; make one with: {make}")
    for role, want in (("target", dtype), ("drafter", drafter_dtype)):
        got = getattr(cal, role).dtype
        if want is not None and got != want:
            raise OmniDraftError(f"{where} timed the {role} in {got}, this run's {role} runs {want}; make one with: "
                                 f"{make}")


# --------------------------------------------------------------------------------------- measuring


def check_calibrate_config(cfg: DictConfig) -> None:
    """Everything ``omnidraft calibrate`` can check before a model loads.

    Raises:
        OmniDraftError: a schema violation (``calibrate.repeats < 1``, ...), no drafter, or
            ``calibrate.tokens_per_forward`` empty or holding a value < 1.
    """
    check_schema(cfg)
    if cfg.get("drafter") is None:
        raise OmniDraftError("omnidraft calibrate times the target and the drafter, and this config has no drafter "
                             "(drafter: null, e.g. from method=ar): drop that override or pass drafter=<name>")
    ns = list(cfg.calibrate.tokens_per_forward)
    if not ns:
        raise OmniDraftError("calibrate.tokens_per_forward is empty: list the tokens per forward to time, e.g. [1,2,4,8]")
    bad = [n for n in ns if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise OmniDraftError(f"calibrate.tokens_per_forward={ns}: every value must be an integer >= 1 "
                             f"(bad: {', '.join(map(str, bad))})")


def isa_tag(flags: set[str] | frozenset[str]) -> str:
    """The widest matrix ISA a CPU's flags name, which decides its speed more than its name does
    (one CPU name has landed as AVX2-only and as AMX machines): ``amx``, ``avx512bf16``,
    ``avx512``, ``avx2`` or ``""``."""
    for tag, flag in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return tag
    return ""


def machine_slug(device: str | torch.device, cpu_name: str | None, flags: set[str] | frozenset[str] = frozenset()) -> str:
    """The machine part of a calibration's file name: the GPU's name on CUDA, else the CPU's name
    and its ISA (:func:`isa_tag` of ``flags``).

    Args:
        device: the target's device.
        cpu_name: the CPU's name (provenance ``cpu``).
        flags: the CPU's feature flags (:func:`omnidraft.provenance.cpu_flags`).

    Returns:
        Lower-case letters, digits and ``-`` (``(R)``, ``(TM)``, ``CPU`` and the clock dropped):
        ``intel-xeon-platinum-8480-amx``, ``amd-epyc-avx2``, ``nvidia-h200``.
    """
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (cpu_name or "")
    name = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", name, flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or dev.type
    isa = isa_tag(flags) if dev.type == "cpu" else ""
    return f"{slug}-{isa}" if isa and not slug.endswith(isa) else slug


def _dtype_part(cfg: DictConfig) -> str:
    t, d = str(cfg.target.dtype), str(cfg.drafter.dtype)
    return t if t == d else f"{t}-{d}"


def calibration_path(cfg: DictConfig, machine: str, threads: int) -> Path:
    """The calibration file of a config: ``calibrate.out``, or by default
    ``<paths.results_dir>/calibration/<target>-<drafter>/<machine>_<dtype>_<threads>t.json``
    (``<dtype>``: the target's dtype, ``<target dtype>-<drafter dtype>`` where they differ; ``auto``
    resolved).

    Args:
        cfg: the run's config.
        machine: :func:`machine_slug`.
        threads: torch's CPU threads.
    """
    node = cfg.get("calibrate")
    out = node.get("out") if node is not None else None
    if out:
        return Path(out)
    return (Path(cfg.paths.results_dir) / "calibration" / f"{cfg.target.name}-{cfg.drafter.name}"
            / f"{machine}_{_dtype_part(cfg)}_{threads}t.json")


def _check_positions(lm: LoadedModel, role: str, need: int) -> None:
    window = sliding_window(lm.model.config)
    limit = min(lm.max_context, window) if window is not None else lm.max_context
    if need > limit:
        raise OmniDraftError(f"calibrate.context_tokens plus the largest calibrate.tokens_per_forward need {need} "
                             f"positions, the {role} {lm.name} has {limit}; lower them")


def _ids(n: int, vocab: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=generator).tolist()


def _vocab(lm: LoadedModel) -> int:
    """Ids every part of the model accepts: within its embedding and its tokenizer."""
    return min(lm.model.get_input_embeddings().weight.shape[0], len(lm.tokenizer))


Forward = Callable[[Any, list[int], Any], Any]
_FORWARDS: dict[str, Forward] = {
    "target": lambda m, ids, c: kv.forward(m, ids, c),  # the verifier's: logits of every position
    "drafter": lambda m, ids, c: kv.forward(m, ids, c, keep=1),  # drafting: the last position's
    "drafter_hidden": lambda m, ids, c: kv.forward_hidden(m, ids, c),  # drafting for the acceptance head
}


def time_forwards(lm: LoadedModel, forward: Forward, ns: Sequence[int], *, context: list[int],
                  new_ids: list[int], repeats: int, warmup: int,
                  on_round: Callable[[], None] | None = None) -> dict[int, Timing]:
    """Time forwards of ``n`` new tokens after a cached context, for each ``n``.

    The context is prefilled once; each forward feeds ``new_ids[:n]`` after it and the cache is
    cropped back to the context (:func:`omnidraft.core.kv.crop_to`). ``warmup`` untimed rounds,
    then ``repeats`` timed ones; a round runs every ``n`` once. CUDA is synchronised around each
    timed forward.

    Args:
        lm: the model.
        forward: ``(model, ids, cache) -> outputs``, one of the decode loop's forwards.
        ns: new tokens per forward.
        context: the cached prefix, in the model's ids.
        new_ids: at least ``max(ns)`` ids fed after it.
        repeats: timed rounds.
        warmup: untimed rounds before them.
        on_round: called after each round (progress).

    Returns:
        ``{n: Timing}``.
    """
    model = lm.model
    cuda = torch.device(lm.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(lm.device)

    cache = kv.new_cache(model)
    kv.forward(model, context, cache, keep=1)
    keep = kv.cache_len(cache)
    secs: dict[int, list[float]] = {n: [] for n in ns}
    for r in range(warmup + repeats):
        for n in ns:
            sync()
            t0 = time.perf_counter()
            forward(model, new_ids[:n], cache)
            sync()
            dt = time.perf_counter() - t0
            kv.crop_to(cache, keep)
            if r >= warmup:
                secs[n].append(dt)
        if on_round is not None:
            on_round()
    return {n: Timing(statistics.median(v), min(v), max(v)) for n, v in secs.items()}


def markdown(obj: dict[str, Any]) -> str:
    """The Markdown table of a calibration file's content: median ms per ``n`` (min-max).

    Args:
        obj: the calibration as written (see the module docstring).

    Returns:
        A heading line, the setting, and one row per ``n``.
    """
    m, prov = obj["models"], obj.get("provenance") or {}
    t, d = m["target"], m["drafter"]
    cols = [("target", "forward", f"target {t['name']} (all logits)"),
            ("drafter", "forward", f"drafter {d['name']}"),
            ("drafter", "forward_hidden", f"drafter {d['name']} + hidden")]

    def cell(role: str, table: str, n: int) -> str:
        x = m[role][table].get(str(n))
        if x is None:
            return "-"
        return f"{x['median_s'] * 1e3:.3f} ({x['min_s'] * 1e3:.3f}-{x['max_s'] * 1e3:.3f})"

    gpu = f", GPU {prov['gpu']}" if prov.get("gpu") else ""
    git = f"{str(prov.get('git_hash'))[:10]}{' (dirty)' if prov.get('git_dirty') else ''}"
    setting = (f"Milliseconds per forward of n new tokens after a cached context of {obj['context_tokens']} "
               f"tokens: median (min-max) over repeats={obj['repeats']} after warmup={obj['warmup']} rounds. "
               f"Target {t['dtype']} on {t['device']}, drafter {d['dtype']} on {d['device']}, "
               f"threads={t['threads']}; CPU {prov.get('cpu')} ({prov.get('cpu_capability')}){gpu}; git {git}. "
               "Written by `omnidraft calibrate`.")
    lines = [f"# Latency calibration: {t['name']} / {d['name']} on {obj['machine']}", "", setting, "",
             "| n | " + " | ".join(c[2] for c in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for n in obj["tokens_per_forward"]:
        lines.append(f"| {n} | " + " | ".join(cell(r, tb, n) for r, tb, _ in cols) + " |")
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _as_json(timings: dict[int, Timing]) -> dict[str, dict[str, float]]:
    return {str(n): {"median_s": x.median_s, "min_s": x.min_s, "max_s": x.max_s} for n, x in sorted(timings.items())}


def run_calibrate(cfg: DictConfig) -> dict[str, Any]:
    """Time the target's and the drafter's forwards on this machine and write the calibration.

    Args:
        cfg: a ``conf/calibrate.yaml`` config (task and method are ignored).

    Returns:
        The summary (also ``run_dir/summary.json``): the file written, the medians, provenance.

    Raises:
        OmniDraftError: a bad ``calibrate`` setting, no drafter, a context too long for a model.
    """
    check_calibrate_config(cfg)
    resolve_dtypes(cfg)
    c = cfg.calibrate
    ns = sorted({int(n) for n in c.tokens_per_forward})
    n_ctx, repeats, warmup = int(c.context_tokens), int(c.repeats), int(c.warmup)
    cache_dir = Path(cfg.paths.cache_dir)
    t_load = time.perf_counter()
    lms = {role: load_model(to_plain(cfg[role]), cache_dir) for role in ROLES}
    load_s = time.perf_counter() - t_load
    for role, lm in lms.items():
        _check_positions(lm, role, n_ctx + ns[-1])

    ctx = RunContext(cfg, command_overrides(cfg))  # sets torch's threads (cfg.threads)
    threads = torch.get_num_threads()
    machine = machine_slug(lms["target"].device, ctx.prov.get("cpu"), cpu_flags())
    out = calibration_path(cfg, machine, threads)
    ctx.fresh()
    log = ctx.open_log(sinks=False)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    results: dict[str, dict[int, Timing]] = {}
    written: list[str] = []

    def summary_of(status: str) -> dict[str, Any]:
        med = {f"{role}/{n}": x.median_s for role, tab in results.items() for n, x in tab.items()}
        return {"status": status, "calibration": written[0] if written else None, "machine": machine,
                "target": cfg.target.name, "drafter": cfg.drafter.name, "dtype": _dtype_part(cfg),
                "threads": threads, "context_tokens": n_ctx, "repeats": repeats, "warmup": warmup,
                "tokens_per_forward": ns, "median_s": med, "time/load_s": load_s, "provenance": ctx.prov}

    step = 0
    with ctx.finishing(summary_of):
        bar = tqdm(total=(warmup + repeats) * 3, desc=f"calibrate {cfg.target.name}/{cfg.drafter.name}",
                   unit="round", disable=not cfg.progress, dynamic_ncols=True)
        for role in ROLES:
            lm = lms[role]
            context, new_ids = _ids(n_ctx, _vocab(lm), gen), _ids(ns[-1], _vocab(lm), gen)
            for key in (role, *(["drafter_hidden"] if role == "drafter" else [])):
                results[key] = time_forwards(lm, _FORWARDS[key], ns, context=context, new_ids=new_ids,
                                             repeats=repeats, warmup=warmup, on_round=lambda: bar.update(1))
                for n, x in results[key].items():
                    log.log({"model": key, "n": n, "median_s": x.median_s, "min_s": x.min_s, "max_s": x.max_s},
                            step=step)
                    step += 1
        bar.close()

        def model_entry(role: str) -> dict[str, Any]:
            lm, node = lms[role], cfg[role]
            e = {"name": str(node.name), "source": str(node.source), "dtype": str(node.dtype),
                 "device": str(lm.device), "threads": threads, "forward": _as_json(results[role])}
            if role == "drafter":
                e["forward_hidden"] = _as_json(results["drafter_hidden"])
            return e

        obj = {"format": FORMAT, "kind": KIND, "machine": machine, "context_tokens": n_ctx, "repeats": repeats,
               "warmup": warmup, "tokens_per_forward": ns, "seed": int(cfg.seed),
               "models": {role: model_entry(role) for role in ROLES}, "provenance": ctx.prov}
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, obj)
        _write_text(out.with_suffix(".md"), markdown(obj))
        written.append(str(out))
    return ctx.summary
