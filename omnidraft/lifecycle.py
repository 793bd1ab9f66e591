"""A run's lifecycle, one for every command that writes a run directory (stream, bench, distill).

The steps, in order:

1. Before the run starts, :func:`check_resume` compares a checkpoint's saved :func:`fingerprint`
   with this config and refuses a resume that changed anything but :data:`_RESUME_FREE` keys,
   naming the first key that differs.
2. ``RunContext(cfg, overrides)`` creates ``run_dir`` and writes its portable ``config.yaml`` and
   ``provenance.json`` (at the start: a run killed before its summary keeps them).
3. :meth:`RunContext.fresh` or :meth:`RunContext.resume` says where the run begins: a fresh
   ``metrics.jsonl``, or its rows up to the checkpoint rewritten; provenance gets one segment per
   start.
4. :meth:`RunContext.open_log` opens ``metrics.jsonl`` and, for the stream runner, the ``logger``
   config's sinks (wandb, ...).
5. ``with ctx.finishing(make_summary):`` wraps the work. Whatever happens in it, the summary is
   built with the run's status (``ok`` or ``failed: Type: msg``) and written atomically, then the
   loggers close; an exception is re-raised.

It reads only the config keys every command shares (``run_dir``, ``seed``, ``threads``,
``checkpoint_every``, ``logger``, ``paths``); methods, drafters and sessions are the commands'.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from omnidraft import provenance
from omnidraft.data.models import resolve_device, resolve_dtype
from omnidraft.errors import OmniDraftError
from omnidraft.instantiate import call_with
from omnidraft.loggers import JSONLLogger, MultiLogger

# Config keys that may change when a run is resumed (everything else must match the checkpoint).
_RESUME_FREE = {"resume", "progress", "threads", "run_dir", "logger", "paths", "overrides",
                "checkpoint_every", "state_dir"}

# Config keys that only feed interpolations: what they change is in the resolved values that read
# them (``ngram_reference_size`` -> an evict_* row's ``ngram.capacity``), so a cell that reads none
# (Table 14's `l_dm` and `hybrid`) is the same cell as another table's whatever their value.
_CELL_FREE = {"ngram_reference_size"}
# The same, inside a node: ``target_switch``'s named schedules feed ``target_switch.targets``.
_CELL_FREE_IN = {"target_switch": {"schedule", "schedules", "partners"}}

# Arguments the lifecycle supplies to each ``logger`` sink it builds (each gets those it accepts).
LOGGER_RUNTIME_ARGS = {"run_dir", "run_config"}


def portable_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config with machine-specific paths made portable for the record.

    Paths under the working directory become relative, the home directory becomes ``~``, wherever
    they occur (``run_dir``, ``paths.*``, ``replay.rows_cache``, ``drafter.init_state`` ...).

    Args:
        cfg: the run's config.

    Returns:
        The resolved config as plain containers.
    """
    c = OmegaConf.to_container(cfg, resolve=True)
    home, cwd = str(Path.home()), os.getcwd()

    def fix(p):
        if not isinstance(p, str) or not os.path.isabs(p):
            return p
        if p == cwd or p.startswith(cwd + os.sep):
            return os.path.relpath(p, cwd)
        return "~" + p[len(home):] if p.startswith(home + os.sep) else p

    def walk(node):  # every path-like string (run_dir, paths.*, replay.rows_cache, init_state ...)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return fix(node)

    return walk(c)


def to_plain(node) -> dict | None:
    """A config node as plain Python containers (interpolations resolved); None stays None."""
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def group_choices() -> dict[str, str]:
    """Config group choices of this run (target, drafter, method, ablation, ...), when run by Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return {k: v for k, v in HydraConfig.get().runtime.choices.items()
                if not k.startswith("hydra") and v is not None}
    except ValueError:
        return {}


def command_overrides(cfg: DictConfig) -> list[str]:
    """``cfg.overrides`` where set (tests, notebooks, a config derived from another:
    :func:`omnidraft.runner.train_stream_config`), else the command line's overrides under Hydra."""
    if cfg.get("overrides"):
        return list(cfg.overrides)
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return list(cfg.get("overrides") or [])


def overrides_in(cfg: DictConfig, groups: tuple[str, ...]) -> list[str]:
    """The run's overrides (:func:`command_overrides`) of the top-level config groups ``groups``
    (``task=x``, ``task.limit=3``, ``+debug/...``): what a derived command must repeat."""
    return [o for o in command_overrides(cfg)
            if o.lstrip("+~").split("=")[0].split(".")[0].split("/")[0] in groups]


def resolve_dtypes(cfg: DictConfig) -> None:
    """Replace ``device: auto`` (CUDA when present, else CPU; :func:`omnidraft.data.models.resolve_device`)
    and ``dtype: auto`` (bfloat16 where native, else float32; :func:`omnidraft.data.models.resolve_dtype`)
    of the target and drafter by what they mean on this machine, so the saved
    config.yaml and the resume fingerprint name the dtype that actually ran: a stream started in
    bf16 is not silently resumed in fp32 on another machine."""
    for role in ("target", "drafter"):
        node = cfg.get(role)
        if node is None:
            continue
        if "device" in node:  # auto -> cuda / cpu; a CUDA request without CUDA is refused here
            node.device = resolve_device(node.device, f"{role}.device")
        if node.get("dtype") == "auto":
            node.dtype = resolve_dtype("auto", node.get("device", "cpu"))


def start_run(cfg: DictConfig, overrides: list[str]) -> tuple[Path, dict[str, Any]]:
    """Create run_dir, write its portable config.yaml and provenance.json, set torch threads.

    Args:
        cfg: the run's config.
        overrides: the overrides recorded in the provenance.

    Returns:
        ``(run_dir, provenance)``.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(portable_config(cfg)))
    prov = provenance.collect(int(cfg.seed), overrides)
    # also at the start: a run killed before its summary (SIGKILL, machine gone) keeps its provenance
    (run_dir / "provenance.json").write_text(json.dumps(prov, indent=2, default=str))
    return run_dir, prov


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the resolved config less :data:`_RESUME_FREE`
    (and where replay keeps its rows between runs: a cache, not a setting)."""
    return fingerprint_of(OmegaConf.to_container(cfg, resolve=True))


def fingerprint_of(c: dict[str, Any]) -> dict[str, Any]:
    """:func:`fingerprint` of a resolved config as plain containers (a run's ``config.yaml``)."""
    out = {k: v for k, v in c.items() if k not in _RESUME_FREE}
    if isinstance(out.get("replay"), dict):
        out["replay"] = {k: v for k, v in out["replay"].items() if k != "rows_cache"}
    for role in ("target", "drafter"):
        if isinstance(out.get(role), dict):
            out[role] = without_archive_pins(out[role])
    return out


def without_archive_pins(model: dict[str, Any]) -> dict[str, Any]:
    """A model config node less its archives' checksums (``gguf.artifact_sha256``): they say where
    the weights came from, not what runs, so pinning them changes no cell's or trace's identity."""
    gguf = model.get("gguf")
    if not isinstance(gguf, dict) or "artifact_sha256" not in gguf:
        return model
    return {**model, "gguf": {k: v for k, v in gguf.items() if k != "artifact_sha256"}}


def cell_key(cfg: DictConfig) -> str:
    """A run's result identity: the sha256 of its :func:`cell_fingerprint` (dtypes resolved; seed
    included). Two runs with the same key compute the same numbers, whatever experiment, table or
    directory they were launched from (a sweep shares them: :func:`omnidraft.cli.shared_cell`)."""
    return fingerprint_key(cell_fingerprint(cfg))


def fingerprint_key(fp: dict[str, Any]) -> str:
    """The sha256 of a fingerprint (its JSON with sorted keys): :func:`cell_key` of a computed one."""
    import hashlib

    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()


def cell_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What makes a run's numbers: :func:`cell_fingerprint_of` its portable resolved config, dtypes resolved."""
    c = cfg.copy()
    resolve_dtypes(c)
    return cell_fingerprint_of(portable_config(c))


def cell_fingerprint_of(config: dict[str, Any]) -> dict[str, Any]:
    """:func:`fingerprint_of` a resolved config (a run's ``config.yaml`` as written), less :data:`_CELL_FREE`
    and :data:`_CELL_FREE_IN`."""
    out = {k: v for k, v in fingerprint_of(config).items() if k not in _CELL_FREE}
    for node, keys in _CELL_FREE_IN.items():
        if isinstance(out.get(node), dict):
            out[node] = {k: v for k, v in out[node].items() if k not in keys}
    return out


def same_cell(written: dict[str, Any], fp: dict[str, Any]) -> bool:
    """Whether a finished run's ``config.yaml`` (``written``) computed the cell whose
    :func:`cell_fingerprint` is ``fp``: every key it wrote has fp's value, and every key it lacks
    (one newer code added) has its schema default in fp, the value that keeps what ran before. A
    key it lacks that fp sets otherwise, or that the schema does not know, makes another cell."""
    w = cell_fingerprint_of(written)
    return _diff(w, fp) is None and _added_off_default(w, fp, schema_defaults()) is None


_NO_DEFAULT = object()


@functools.cache
def schema_defaults() -> dict[str, Any]:
    """The config schema's defaults as plain containers (:class:`omnidraft.config.Config`; its model,
    task and method nodes from their own dataclasses); built once, read only."""
    from omnidraft.config import Config, MethodConfig, ModelConfig, TaskConfig

    def plain(node) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(node), resolve=False, throw_on_missing=False)

    return {**plain(Config), "target": plain(ModelConfig), "drafter": plain(ModelConfig),
            "task": plain(TaskConfig), "method": plain(MethodConfig)}


def _added_off_default(written: dict[str, Any], now: dict[str, Any], defaults: Any, prefix: str = "") -> str | None:
    """The first key of ``now`` absent from ``written`` whose value is not its schema default (or
    that the schema has no default for); None when there is none."""
    for k, v in now.items():
        d = defaults.get(k, _NO_DEFAULT) if isinstance(defaults, dict) else _NO_DEFAULT
        if k not in written:
            if d is _NO_DEFAULT or d != v:
                return f"{prefix}{k}"
        elif isinstance(v, dict) and isinstance(written[k], dict):
            found = _added_off_default(written[k], v, d, f"{prefix}{k}.")
            if found:
                return found
    return None


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


def check_resume(cfg: DictConfig, saved: dict[str, Any], where: str, advice: str) -> None:
    """Refuse to resume a checkpoint saved under another config.

    Args:
        cfg: this run's config.
        saved: the :func:`fingerprint` the checkpoint was saved with.
        where: what is resumed, for the message (``"from results/x/state"``).
        advice: what to do instead, for the message.

    Raises:
        OmniDraftError: ``cannot resume <where>: the config differs (<first difference>); <advice>``.
    """
    d = _diff(saved, fingerprint(cfg))
    if d:
        raise OmniDraftError(f"cannot resume {where}: the config differs ({d}); {advice}")


def write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON atomically (a ``.tmp`` file renamed): whole or absent, never half.

    Args:
        path: the file to write.
        obj: JSON-serialisable data (other objects are written as ``str``).
        indent: as :func:`json.dumps`.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent, default=str))
    os.replace(tmp, path)


class RunContext:
    """One run directory from its start to its summary.

    Constructing it starts the run (:func:`start_run`). Then :meth:`fresh` or :meth:`resume`,
    :meth:`open_log`, and the work inside ``with ctx.finishing(make_summary):``.

    Attributes:
        cfg: the run's config.
        run_dir: the run directory.
        prov: the provenance (also in ``provenance.json`` and the summary); :meth:`fresh` and
            :meth:`resume` add its ``segments``.
        start: the index of the first item this process runs (0 unless resumed).
        resumed_at: ``start`` when resumed, else None.
        segments: one provenance segment per start of the run (see :func:`provenance.segment`).
        log: the loggers, once :meth:`open_log` opened them.
        status: ``ok``, or ``failed: Type: msg`` once the work raised.
        summary: what ``make_summary`` returned, once :meth:`finishing` exited.
    """

    def __init__(self, cfg: DictConfig, overrides: list[str]):
        """Create run_dir, write config.yaml and provenance.json.

        Args:
            cfg: the run's config (dtypes resolved, see :func:`resolve_dtypes`).
            overrides: the overrides recorded in the provenance.
        """
        self.cfg = cfg
        self.run_dir, self.prov = start_run(cfg, overrides)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.start = 0
        self.resumed_at: int | None = None
        self.segments: list[dict[str, Any]] = []
        self.log: MultiLogger | None = None
        self.status = "ok"
        self.summary: dict[str, Any] = {}

    def drop_metrics(self) -> None:
        """Delete the metrics.jsonl an earlier run left in this directory."""
        if self.metrics_path.exists():
            self.metrics_path.unlink()

    def fresh(self) -> None:
        """Begin at item 0: a fresh metrics.jsonl and one provenance segment."""
        self.drop_metrics()  # a fresh run in an old directory starts a fresh log
        self._add_segment([], 0)

    def resume(self, start: int, segments: list[dict[str, Any]], rows: Iterable[tuple[int, dict[str, Any]]]) -> None:
        """Continue a checkpointed run at item ``start``.

        Args:
            start: the first item not in the checkpoint.
            segments: the checkpoint's provenance segments; this process adds one at ``start``.
            rows: ``(step, row)`` pairs of the checkpoint, in order: metrics.jsonl is rewritten to
                hold exactly them (rows logged after the checkpoint go).
        """
        self.start = self.resumed_at = start
        with open(self.metrics_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **row}, default=str) + "\n" for step, row in rows)
        self._add_segment(segments, start)

    def _add_segment(self, earlier: list[dict[str, Any]], start: int) -> None:
        self.segments = list(earlier) + [provenance.segment(self.prov, start)]
        self.prov["segments"] = self.segments

    def open_log(self, sinks: bool = True) -> MultiLogger:
        """Open metrics.jsonl for appending and, with ``sinks``, the ``logger`` config's sinks.

        Args:
            sinks: also build each ``cfg.logger`` node, given the run_dir and resolved config
                (:data:`LOGGER_RUNTIME_ARGS`) it accepts.

        Returns:
            The loggers, also :attr:`log`; :meth:`finishing` closes them.
        """
        loggers = [JSONLLogger(self.metrics_path)]
        if sinks:
            for node in (self.cfg.logger or {}).values():
                make = instantiate(node, _partial_=True)  # runtime args passed as plain objects, not configs
                loggers.append(call_with(make, run_dir=str(self.run_dir),
                                         run_config=OmegaConf.to_container(self.cfg, resolve=True)))
        self.log = MultiLogger(loggers)
        return self.log

    def checkpoint_due(self, i: int, n: int) -> bool:
        """Whether to checkpoint after item ``i`` (0-based) of ``n``: every ``checkpoint_every``
        items (0: never) and after the last."""
        every = int(self.cfg.checkpoint_every)
        return (every > 0 and (i + 1) % every == 0) or i + 1 == n

    @contextlib.contextmanager
    def finishing(self, make_summary: Callable[[str], dict[str, Any]],
                  write: Callable[[dict[str, Any]], None] | None = None) -> Iterator[RunContext]:
        """Run the body; then, whatever happens, summarise, write, log and close.

        Args:
            make_summary: builds the summary from the status (``ok`` or ``failed: Type: msg``)
                and what was computed so far.
            write: writes the summary; default: ``run_dir/summary.json``, atomically.

        Yields:
            This context. An exception of the body is re-raised after the summary is written.
        """
        try:
            yield self
        except BaseException as e:  # keep what was computed, then re-raise
            self.status = f"failed: {type(e).__name__}: {e}"
            raise
        finally:
            self.summary = make_summary(self.status)
            if write is None:
                write_json(self.run_dir / "summary.json", self.summary)
            else:
                write(self.summary)
            if self.log is not None:
                self.log.log_summary(self.summary)
                self.log.close()
