"""``engine=replay``: a stream verified by the target's recorded greedy trajectories.

The runner (:func:`omnidraft.runner.run`) decodes the same prompts with the same decode loop,
drafters and observers as a live run; only the verifier differs
(:class:`omnidraft.core.verifiers.TraceVerifier`): acceptance comes from comparing proposals with
the trace, and learning observers get the target's rows in one batched forward per prompt
(:func:`omnidraft.core.verifiers.rows_at_end`). Speed is modelled from this machine's latency
calibration (``omnidraft calibrate``): ``speed/modelled_speedup``.

This module opens what a replay reads and checks it against the run: :func:`open_replay`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from omnidraft.calibrate import (
    Calibration,
    StepShape,
    calibration_path,
    check_calibration,
    load_calibration,
    machine_slug,
    modelled_speedup,
    step_seconds,
)
from omnidraft.core.decode import GenerationResult
from omnidraft.data.tasks import Record
from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import overrides_in
from omnidraft.provenance import cpu_flags, cpu_name
from omnidraft.trace import (
    LINES_FILE,
    META_FILE,
    check_trace,
    file_sha256,
    read_trace,
    request_for,
    trace_command,
    trace_dir,
)


@dataclass
class Replay:
    """What a replay run reads.

    Attributes:
        trajectories: prompt ids (every turn of every record of the run) -> the trace's output ids.
        calibration: this machine's latency calibration, or None for a method with no target
            steps to model (``ar``: its modelled speedup is 1 by definition).
        info: the ``replay/*`` provenance: trace directory, sha256 of its lines file, lines used,
            the calibration file and its machine.
    """

    trajectories: dict[tuple[int, ...], list[int]]
    calibration: Calibration | None
    info: dict[str, Any] = field(default_factory=dict)
    target_identity: dict[str, Any] = field(default_factory=dict)  # the trace's target (model, dtype, tokenizer)

    def merge(self, other: Replay) -> None:
        """Add another stream's trajectories (protocol=train_test: the train slice's trace); its
        trace is recorded under ``replay/train_*``."""
        self.trajectories.update(other.trajectories)
        self.info.update({k.replace("replay/trace", "replay/train_trace"): v for k, v in other.info.items()
                          if k.startswith("replay/trace")})

    def row(self, sd: GenerationResult) -> dict[str, float]:
        """One generation's modelled speed keys (:func:`step_shapes`)."""
        if self.calibration is None:
            return {}
        return speed_keys(self.calibration, step_shapes(sd), sd.n_new)


def step_shapes(sd: GenerationResult) -> list[StepShape]:
    """The forwards of every step of a generation, for the latency model (:func:`shapes`)."""
    return shapes([s.proposed for s in sd.steps], [s.draft_feeds for s in sd.steps],
                  [s.draft_hidden for s in sd.steps])


def row_shapes(row: dict[str, Any]) -> list[StepShape] | None:
    """The step shapes a row records (``sd/step_proposed``, ``sd/step_feeds``, ``sd/step_hidden``),
    the same :func:`step_shapes` gave when it ran; None for a row written before rows recorded them."""
    if "sd/step_feeds" not in row:
        return None
    n = len(row["sd/step_proposed"])
    return shapes(row["sd/step_proposed"], row["sd/step_feeds"], row.get("sd/step_hidden") or [0] * n)


def shapes(proposed: Sequence[int], feeds: Sequence[Sequence[int]], hidden: Sequence[bool | int]) -> list[StepShape]:
    """Each step's forwards. The target's forward feeds the pending token and the proposals. The
    drafter's forwards feed what its step recorded (:attr:`omnidraft.core.decode.StepRecord.draft_feeds`),
    except that the first step's first forward, which also prefills the drafter with the prompt,
    counts as one token: prefill is left out of the modelled speedup, on both sides."""
    out = []
    for i, (p, f, h) in enumerate(zip(proposed, feeds, hidden, strict=True)):
        f = tuple(int(x) for x in f)
        if i == 0 and f:
            f = (1, *f[1:])
        out.append(StepShape(int(p) + 1, f, bool(h)))
    return out


def speed_keys(cal: Calibration, shapes_: Sequence[StepShape], new_tokens: int) -> dict[str, float]:
    """A row's modelled speed keys under a calibration: its steps' modelled seconds, one plain
    step's, and the modelled speedup."""
    return {"speed/modelled_sd_s": sum(step_seconds(cal, s) for s in shapes_),
            "speed/modelled_ar_step_s": cal.target_s(1),
            "speed/modelled_speedup": modelled_speedup(cal, shapes_, new_tokens)}


def check_replay_config(cfg: DictConfig) -> None:
    """What ``engine=replay`` refuses before a model loads.

    Raises:
        OmniDraftError: sampling (a trace is one greedy trajectory), a method that runs
            transformers' own generation loop (it has no verifier seam), or a task switch whose
            segments are no slices of their tasks' traces (shuffled, or with a target switch).
    """
    m = cfg.method
    if float(m.temperature) > 0:
        raise OmniDraftError(f"engine=replay verifies greedily against a recorded target trace; "
                             f"method.temperature={float(m.temperature):g} samples: set method.temperature=0 "
                             "or verify live (engine=live)")
    if m.engine == "hf_assisted":
        raise OmniDraftError(f"method={m.name} runs transformers' own generation loop, which cannot replay a "
                             "trace: run it with engine=live")
    if cfg.task.name == "switch":  # each task segment replays from its own task's trace
        if cfg.task.shuffle:
            raise OmniDraftError("engine=replay with task=switch needs task.shuffle=false: a shuffled component is "
                                 "no slice of its task's trace; drop task.shuffle or run engine=live")
        if cfg.replay.trace:
            raise OmniDraftError(f"replay.trace={cfg.replay.trace} names one trace, and task=switch replays each "
                                 "task from its own (<paths.results_dir>/traces/<target>/<task>): drop replay.trace")
        if len(set(cfg.target_switch.targets or [])) > 1:
            raise OmniDraftError("engine=replay runs task=switch or target_switch, not both in one stream: its "
                                 "segments would need a trace per target and task; run engine=live")


# the config groups whose overrides decide a calibration's models, dtypes and file
_CALIBRATE_GROUPS = ("target", "drafter", "paths", "debug", "pair", "experiment", "scale")


def calibrate_command_for(cfg: DictConfig, threads: int) -> str:
    """The ``omnidraft calibrate`` command that makes the calibration a replay of ``cfg`` reads: the
    run's overrides of the groups that decide it, and this process's thread count."""
    keep = overrides_in(cfg, _CALIBRATE_GROUPS)
    return " ".join(["omnidraft calibrate", *(shlex.quote(o) for o in keep), f"threads={threads}"])


class TrajectoryStore:
    """The drafter-independent half of a replay's batched rows, kept on disk between runs: per
    prompt, the target's key/value cache after the prompt and its whole traced output, and the last
    layer's states there (:meth:`omnidraft.core.verifiers.TraceVerifier.step_rows` computes the
    rest, each step's drafted branch, every time). One safetensors file per (prompt, output) under
    ``root/<namespace>/``, the namespace a hash of the target's identity (model, dtype, device,
    tokenizer: the trace's), torch's version and the thread count, so states computed under other
    numerics are never mixed in. Files are written atomically; an unreadable one is recomputed.
    With it a table's runs (rows x seeds) pay the trajectory's target forward once per prompt.

    Args:
        root: the store's directory (``replay.rows_cache``).
        target_identity: the trace's ``identity.target``.
        model: the target model (its config rebuilds the cache).
    """

    FORMAT = 1

    def __init__(self, root: str | Path, target_identity: dict[str, Any], model):
        ns = {"format": self.FORMAT, "target": target_identity, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
        self.dir = Path(root) / hashlib.sha256(json.dumps(ns, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.model = model
        self.hits = 0
        self.misses = 0

    def _file(self, prompt: Sequence[int], out: Sequence[int]) -> Path:
        key = hashlib.sha256(json.dumps([list(prompt), list(out)]).encode()).hexdigest()[:32]
        return self.dir / f"{key}.safetensors"

    def get(self, prompt: Sequence[int], out: Sequence[int]):
        """(cache, states) of this prompt's trajectory, or None when not stored (or unreadable)."""
        from safetensors import SafetensorError, safe_open

        from omnidraft.core import kv

        f = self._file(prompt, out)
        if not f.is_file():
            self.misses += 1
            return None
        try:
            with safe_open(str(f), "pt") as h:
                meta = h.metadata() or {}
                n = int(meta.get("layers", -1))
                if int(meta.get("positions", -1)) != len(prompt) + len(out):
                    raise ValueError("positions")
                layers = [(h.get_tensor(f"k.{i}"), h.get_tensor(f"v.{i}")) for i in range(n)]
                states = h.get_tensor("states")
        except (SafetensorError, OSError, ValueError, KeyError):
            self.misses += 1
            return None
        self.hits += 1
        dev = self.model.device
        return kv.cache_from([(k.to(dev), v.to(dev)) for k, v in layers], self.model), states.to(dev)

    def put(self, prompt: Sequence[int], out: Sequence[int], cache, states) -> None:
        """Keep this prompt's trajectory cache and states (atomically: whole or absent)."""
        from safetensors.torch import save_file

        from omnidraft.core import kv

        layers = kv.cache_tensors(cache)
        tensors = {"states": states.detach().cpu().contiguous()}
        for i, (k, v) in enumerate(layers):
            tensors[f"k.{i}"] = k.detach().cpu().contiguous()
            tensors[f"v.{i}"] = v.detach().cpu().contiguous()
        self.dir.mkdir(parents=True, exist_ok=True)
        f = self._file(prompt, out)
        tmp = f.with_name(f"{f.stem}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"layers": str(len(layers)),
                                               "positions": str(len(prompt) + len(out))})
        os.replace(tmp, f)


def open_replay(cfg: DictConfig, tokenizer, records: Sequence[Record], first_prompt_ids: Sequence[Sequence[int]],
                uses_drafter_model: bool) -> Replay:
    """Read and check the trace and the calibration a replay of ``cfg`` needs.

    Args:
        cfg: the run's config (dtypes resolved).
        tokenizer: the run's target tokenizer.
        records: the run's prompt stream.
        first_prompt_ids: each record's first-turn prompt in target ids.
        uses_drafter_model: the method drafts with a model (its latency is then checked to be the
            run's drafter's, in its dtype).

    Returns:
        The trajectories of every prompt the run decodes, the calibration and the provenance.

    Raises:
        OmniDraftError: no trace, one that does not fit the run (:func:`omnidraft.trace.check_trace`),
            no calibration for this machine, or one of another pair or dtype; each on one line
            with the command that makes the right one.
    """
    path = Path(cfg.replay.trace) if cfg.replay.trace else trace_dir(cfg)
    if not (path / META_FILE).is_file():
        raise OmniDraftError(f"engine=replay needs a target trace and {path} holds none; make it with: "
                             f"{trace_command(cfg)}")
    trace = read_trace(path)
    want = request_for(cfg, tokenizer, records, first_prompt_ids)
    check_trace(trace, want)
    trajectories: dict[tuple[int, ...], list[int]] = {}
    for p in want.prompts:
        for turn in range(p.turns):
            line = trace.get(p.index, turn)
            trajectories[tuple(line.prompt_ids)] = list(line.output_ids)
    info: dict[str, Any] = {"replay/trace": str(path), "replay/trace_sha256": file_sha256(path / LINES_FILE),
                            "replay/trace_lines": len(trajectories),
                            "replay/trace_dtype": trace.identity["target"].get("dtype")}
    cal = None
    if cfg.method.name != "ar":
        cal = machine_calibration(cfg, uses_drafter_model, "engine=replay models speed from")
        info.update({"replay/calibration": str(cal.path), "replay/calibration_machine": cal.machine,
                     "replay/speed_target_dtype": cal.target.dtype})
    return Replay(trajectories, cal, info, dict(trace.identity["target"]))


def machine_calibration(cfg: DictConfig, uses_drafter_model: bool, who: str) -> Calibration:
    """This machine's latency calibration for ``cfg``'s pair and dtypes: ``replay.calibration``, or
    the file ``omnidraft calibrate`` writes for this machine and thread count, checked.

    Args:
        cfg: the run's config (dtypes resolved).
        uses_drafter_model: whether the drafter's latencies must be this run's drafter's.
        who: what needs it, for the message (``"engine=replay models speed from"``).

    Raises:
        OmniDraftError: no such file (with the command that makes it), or one of another pair or dtype.
    """
    threads = torch.get_num_threads()
    device = str(cfg.target.device)
    speed_dtype = cfg.replay.get("speed_target_dtype")
    if speed_dtype and speed_dtype != cfg.target.dtype:  # time the target as if it ran in that dtype
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.target.dtype = str(speed_dtype)
    cal_path = Path(cfg.replay.calibration) if cfg.replay.calibration else \
        calibration_path(cfg, machine_slug(device, cpu_name(), cpu_flags()), threads)
    drafter = str(cfg.drafter.name) if cfg.drafter is not None else "none"
    drafter_dtype = str(cfg.drafter.dtype) if uses_drafter_model else None
    if not cal_path.is_file():
        raise OmniDraftError(f"{who} this machine's latency calibration, and {cal_path} does not exist: make it "
                             f"with `{calibrate_command_for(cfg, threads)}` (or pass replay.calibration=FILE)")
    cal = load_calibration(cal_path)
    # a drafter forward re-feeding a long cross-vocab emission can exceed the measured n: scale the
    # largest n's time rather than stop mid-stream
    cal.extrapolate = True
    check_calibration(cal, str(cfg.target.name), drafter if uses_drafter_model else cal.drafter.name,
                      str(cfg.target.dtype), drafter_dtype)
    return cal
