"""Loggers behind one small interface. The runner always writes metrics.jsonl itself; these are
extra sinks chosen by the ``logger`` config group (wandb offline by default)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omnidraft.errors import OmniDraftError


class JSONLLogger:
    """Appends one JSON object per ``log`` call; flushed each line so nothing is lost."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._f.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
        self._f.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._f.close()


class WandbLogger:
    """Weights & Biases, offline by default (``mode=offline`` writes under the run directory)."""

    def __init__(self, run_dir: str | Path, run_config: dict | None = None, project: str = "omnidraft",
                 mode: str = "offline", name: str | None = None, group: str | None = None,
                 tags: list[str] | None = None):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        try:
            self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), name=name, group=group,
                                  tags=list(tags or []), config=run_config, reinit="finish_previous")
        except wandb.errors.Error as e:  # no API key, no network, a bad project name...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OmniDraftError(f"logger: wandb (mode={mode}) could not start: {first}; run `wandb login` or set "
                                 "WANDB_API_KEY, or log offline (logger=default)") from None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))}, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, bool, str)):
                self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class MultiLogger:
    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, metrics: dict[str, Any], step: int, sink_prefix: str = "") -> None:
        """``metrics`` to every logger; the extra sinks (wandb) get keys prefixed with ``sink_prefix``
        (the bench logs one row per method at each step: ``<method>/<key>`` there), metrics.jsonl
        the row as it is."""
        for lg in self.loggers:
            if sink_prefix and not isinstance(lg, JSONLLogger):
                lg.log({f"{sink_prefix}{k}": v for k, v in metrics.items()}, step)
            else:
                lg.log(metrics, step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_summary(summary)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
