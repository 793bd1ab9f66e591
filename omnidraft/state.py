"""Online state on disk: drafter/adapter weights, optimiser, n-gram cache, stream position.

Layout of a state directory (written atomically: a complete new directory replaces the old one)::

    state/
      meta.json          stream position, config fingerprint, drafter + learner metadata, segments
      tensors.safetensors  master weights (param.*), AdamW moments (opt.*), unflushed buffer (buffer.*)
      rows.jsonl         the per-prompt rows logged so far (the summary is recomputed from them)

No pickle anywhere: tensors go through safetensors, everything else is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnidraft.errors import OmniDraftError

META, TENSORS, ROWS = "meta.json", "tensors.safetensors", "rows.jsonl"


@dataclass
class SavedState:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


def save(path: str | Path, state: SavedState) -> None:
    """Write ``state`` to ``path`` atomically (``path.new`` is filled, then swapped in)."""
    from safetensors.torch import save_file

    path = Path(path)
    new, old = path.with_name(path.name + ".new"), path.with_name(path.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.tensors.items()}, str(new / TENSORS))
    with open(new / ROWS, "w", encoding="utf-8") as f:
        for r in state.rows:
            f.write(json.dumps(r, default=str) + "\n")
    (new / META).write_text(json.dumps(state.meta, indent=1, default=str))
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


def exists(path: str | Path) -> bool:
    path = Path(path)
    return (path / META).is_file() or (path.with_name(path.name + ".old") / META).is_file()


def load(path: str | Path) -> SavedState:
    """Read a state directory (or the run directory holding ``state/``)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / META).is_file() and (path / "state" / META).is_file():
        path = path / "state"
    if not (path / META).is_file():
        old = path.with_name(path.name + ".old")  # interrupted between the two renames
        if (old / META).is_file():
            path = old
        else:
            raise OmniDraftError(f"no online state in {path} (expected {META}); "
                                 "check the path, or start without resume / init_state")
    meta = json.loads((path / META).read_text())
    tensors = load_file(str(path / TENSORS)) if (path / TENSORS).is_file() else {}
    rows = [json.loads(x) for x in (path / ROWS).read_text().splitlines() if x.strip()] \
        if (path / ROWS).is_file() else []
    return SavedState(meta, tensors, rows)


def load_weights(model, tensors: dict[str, torch.Tensor]) -> int:
    """Copy saved ``param.<name>`` tensors into ``model``'s parameters of the same name."""
    named = dict(model.named_parameters())
    saved = {k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")}
    unknown = [n for n in saved if n not in named]
    if unknown:
        raise OmniDraftError(f"saved drafter state has parameter {unknown[0]!r} that this drafter lacks "
                             f"({len(unknown)} in all): was it saved from another model or with LoRA?")
    with torch.no_grad():
        for n, v in saved.items():
            named[n].copy_(v.to(named[n].dtype))
    return len(saved)


def optimizer_state(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimiser's state as (``<prefix>.<i>.<key>`` tensors, JSON-able metadata)."""
    osd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[str, dict] = {}
    for i, st in osd["state"].items():
        keys[str(i)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{prefix}.{i}.{k}"] = v.contiguous()
                keys[str(i)][k] = "tensor"
            else:
                keys[str(i)][k] = v
    return tensors, {"param_groups": osd["param_groups"], "opt_state": keys}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict,
                         prefix: str) -> None:
    state = {int(i): {k: (tensors[f"{prefix}.{i}.{k}"] if v == "tensor" else v) for k, v in ks.items()}
             for i, ks in meta["opt_state"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state(rng) -> list:
    ver, st, gauss = rng.getstate()
    return [ver, list(st), gauss]


def set_rng_state(rng, s: list) -> None:
    ver, st, gauss = s
    rng.setstate((ver, tuple(st), gauss))
