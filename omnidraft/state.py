"""Online state on disk: drafter/adapter weights, optimiser, n-gram cache, stream position.

Layout of a state directory (written atomically: a complete new directory replaces the old one)::

    state/
      meta.json            stream position, config fingerprint, drafter + learner metadata, segments
      weights.safetensors  the learner's master weights (param.*) and AdamW moments (opt.*)
      tensors.safetensors  every other tensor (unflushed buffer (buffer.*), acceptance head, other
                           targets' parts)
      rows.jsonl           the per-prompt rows logged so far (the summary is recomputed from them)

No pickle anywhere: tensors go through safetensors, everything else is JSON.

The weights change only at an online update, yet a checkpoint follows every prompt: a state that
says which weights it holds (:attr:`SavedState.weights_version`) hard-links the previous
checkpoint's ``weights.safetensors`` when that file holds the same version, so a checkpoint between
updates writes only the small parts. (States from before the split keep everything in
``tensors.safetensors``; :func:`load` reads both layouts.)

One drafter serves many targets. What it keeps PER TARGET, keyed by the target's tokenizer hash, are
its *parts*: the n-gram cache (``meta["drafter"]``), the acceptance head (``head.*``, ``head_opt.*``,
``head_buf.*`` + ``meta["head"]``), the draft-length policy's state (``meta["policy"]``), the online
learner's unflushed examples (``buffer.*``) and, with LoRA, its adapters and their AdamW moments
(``param.*``, ``opt.*``). Full fine-tuning's weights and moments, the learner's RNG and counters are
the drafter's, shared by every target. The ACTIVE target's parts (``meta["tokenizers"]["target"]``,
``target_name``) sit at the top level, as in states from before targets were tracked; every other
target's sit under ``meta["targets"][<hash12>]`` (with ``name`` and the full ``tokenizer`` hash) and
tensors ``targets.<hash12>.<key>``, in the same layout (:func:`target_part`, :func:`with_targets`).
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

META, TENSORS, ROWS, WEIGHTS = "meta.json", "tensors.safetensors", "rows.jsonl", "weights.safetensors"
_WEIGHT_PREFIXES = ("param.", "opt.")  # the learner's weights and moments at the top level (not head_opt.)


@dataclass
class SavedState:
    """A checkpoint's contents.

    Attributes:
        weights_version: None, or a name for the top-level ``param.*`` / ``opt.*`` tensors that
            changes whenever they do (the learner's, :meth:`omnidraft.runner.Session.state`): a
            checkpoint holding the same version reuses the file instead of writing it again.
    """

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    weights_version: str | None = None


def _weights_version_of(f: Path) -> str | None:
    """The version a ``weights.safetensors`` was written with (its header), None if unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as g:
            return (g.metadata() or {}).get("version")
    except (SafetensorError, OSError):  # a cut or missing file: write it again
        return None


def _write_weights(new: Path, old: Path | None, weights: dict[str, torch.Tensor], version: str | None) -> None:
    """``weights`` into ``new``: a hard link to ``old`` (the previous checkpoint's file, holding the
    same version) when given, else written with ``version`` in its header."""
    from safetensors.torch import save_file

    if old is not None:
        try:
            os.link(old, new)
            return
        except OSError:  # a filesystem without hard links: copy
            shutil.copyfile(old, new)
            return
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(new),
              metadata={"version": version} if version is not None else None)


def finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor's elements are all finite, read from its sum.

    A sum is NaN or infinite whenever an element is (inf - inf is NaN). A tensor of finite elements
    whose sum overflows its dtype's range counts as not finite too: a gradient, weight or moment that
    large has diverged all the same. float16 (range 65504) is summed in float32, every other dtype in
    its own (bfloat16 has float32's range). Summing reads each tensor once and makes no boolean copy:
    on a CPU core ~10x faster than ``isfinite`` over a 135M-parameter drafter (checked on every
    mini-batch's gradients and every checkpoint's tensors).

    Args:
        tensors: floating-point tensors, on one device for a single host sync (each tensor on
            another device than the first adds one).

    Returns:
        one flag per tensor, in order ([] for none).
    """
    if not tensors:
        return []
    sums = [t.detach().sum(dtype=torch.float32 if t.dtype == torch.float16 else None) for t in tensors]
    return torch.isfinite(torch.stack([x.to(sums[0].device) for x in sums])).tolist()


def save(path: str | Path, state: SavedState) -> None:
    """Write ``state`` to ``path`` atomically (``path.new`` is filled, then swapped in)."""
    from safetensors.torch import save_file

    path = Path(path)
    weights = {k: v for k, v in state.tensors.items() if k.startswith(_WEIGHT_PREFIXES)}
    reuse = bool(weights) and state.weights_version is not None and \
        _weights_version_of(path / WEIGHTS) == state.weights_version  # checked when it was written
    check = [k for k, v in state.tensors.items() if v.is_floating_point() and not (reuse and k in weights)]
    bad = [k for k, ok in zip(check, finite_each([state.tensors[k] for k in check])) if not ok]
    if bad:  # the learners skip non-finite updates; a state that still holds one is never written
        raise OmniDraftError(f"refusing to checkpoint a non-finite online state ({len(bad)} tensor(s), e.g. "
                             f"{bad[0]}); the previous checkpoint in {path} is kept: lower method.adapt.lr and resume")
    new, old = path.with_name(path.name + ".new"), path.with_name(path.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    try:
        new.mkdir(parents=True)
        if weights:
            _write_weights(new / WEIGHTS, path / WEIGHTS if reuse else None, weights, state.weights_version)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.tensors.items() if k not in weights},
                  str(new / TENSORS))
        with open(new / ROWS, "w", encoding="utf-8") as f:
            for r in state.rows:
                f.write(json.dumps(r, default=str) + "\n")
        (new / META).write_text(json.dumps(state.meta, indent=1, default=str))
    except Exception as e:  # a full disk, a file-size limit, permissions: the last good checkpoint stays
        if not _io_error(e):
            raise
        shutil.rmtree(new, ignore_errors=True)
        kept = (f"the previous checkpoint in {path} is intact: free disk space and rerun with resume=true"
                if exists(path) else "no earlier checkpoint exists: free disk space and rerun")
        why = getattr(e, "strerror", None) or _first_line(e)
        raise OmniDraftError(f"could not write the online state to {new} ({why}); {kept}") from None
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
    meta = read_meta(path / META)
    part = TENSORS
    try:
        tensors = load_file(str(path / TENSORS)) if (path / TENSORS).is_file() else {}
        part = WEIGHTS
        if (path / WEIGHTS).is_file():
            tensors.update(load_file(str(path / WEIGHTS)))
        part = ROWS
        rows = []
        if (path / ROWS).is_file():
            for n, line in enumerate((path / ROWS).read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    part = f"{ROWS} line {n}"
                    rows.append(json.loads(line))
    except Exception as e:
        if not _io_error(e):
            raise
        raise OmniDraftError(f"the online state in {path} is damaged ({part}: {type(e).__name__}: "
                             f"{_first_line(e)}); restore it from a copy, or start a new run_dir / drop init_state") from None
    return SavedState(meta, tensors, rows)


def _io_error(e: BaseException) -> bool:
    """A read or write that failed on the file (OS, decoding, or safetensors' own error type), not a bug."""
    return isinstance(e, (OSError, ValueError)) or type(e).__name__ == "SafetensorError"


def read_meta(path: Path) -> dict[str, Any]:
    """A state's (or a data directory's) ``meta.json`` as a dict.

    Raises:
        OmniDraftError: the file is not a JSON object (empty, cut, garbage), naming it and the fix.
    """
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise OmniDraftError(f"{path} is damaged ({type(e).__name__}: {_first_line(e)}); restore it from a copy, "
                             "or start a new run_dir / drop init_state") from None
    return meta


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


TARGETS = "targets"  # meta key of the parts of every target but the active one
# the per-target keys of the top-level layout (the rest is shared by every target)
_PART_META = ("drafter", "head", "policy", "lora")
_PART_TENSORS = ("head.", "head_opt.", "head_buf.", "buffer.")
_LORA_TENSORS = ("param.", "opt.")


def target_key(tokenizer_hash: str) -> str:
    """The key of a target's parts: its tokenizer hash, 12 hex digits."""
    return tokenizer_hash[:12]


def active_target(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(tokenizer hash, name) of the target whose parts sit at the top level of a state's meta;
    None where the state does not record it (DistillSpec checkpoints, bench states before this)."""
    tk = meta.get("tokenizers") or {}
    name = tk.get("target_name") or ((meta.get("fingerprint") or {}).get("target") or {}).get("name")
    return tk.get("target"), name


def target_names(meta: dict[str, Any]) -> dict[str, str | None]:
    """Every target a state holds parts of: tokenizer hash -> name (the active one first)."""
    h, name = active_target(meta)
    out: dict[str, str | None] = {h: name} if h else {}
    out.update({e["tokenizer"]: e.get("name") for e in (meta.get(TARGETS) or {}).values()})
    return out


def learner_part(tensors: dict[str, torch.Tensor], meta: dict[str, Any], lora: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The per-target part of an online learner's state (``OnlineLearner.state_dict``): its
    unflushed examples and, with LoRA, its adapters and their AdamW moments."""
    prefixes = ("buffer.", *(_LORA_TENSORS if lora else ()))
    keys = ("buffer", *(("names", "param_groups", "opt_state") if lora else ()))
    return ({k: v for k, v in tensors.items() if k.startswith(prefixes)},
            {k: meta[k] for k in keys if k in meta})


def active_part(st: SavedState) -> SavedState:
    """The active target's parts alone, in the top-level layout (what :func:`with_targets` files
    under its key when another target becomes the active one)."""
    lora = bool(st.meta.get("lora"))
    meta = {k: st.meta[k] for k in _PART_META if k in st.meta}
    tensors = {k: v for k, v in st.tensors.items() if k.startswith(_PART_TENSORS)}
    if st.meta.get("learner") is not None:
        lt, meta["learner"] = learner_part(st.tensors, st.meta["learner"], lora)
        tensors.update(lt)
    return SavedState(meta, tensors)


def target_part(st: SavedState, tokenizer_hash: str) -> SavedState | None:
    """The parts ``st`` holds for the target of ``tokenizer_hash``, in the top-level layout: the
    state itself for its active target, its ``targets.<hash12>.`` section for another; None when it
    holds none (or does not record its target: see :func:`active_target`)."""
    if active_target(st.meta)[0] == tokenizer_hash:
        return st
    key = target_key(tokenizer_hash)
    entry = (st.meta.get(TARGETS) or {}).get(key)
    if entry is None or entry.get("tokenizer") != tokenizer_hash:
        return None
    p = f"{TARGETS}.{key}."
    return SavedState(dict(entry), {k[len(p):]: v for k, v in st.tensors.items() if k.startswith(p)})


def other_parts(st: SavedState) -> dict[str, SavedState]:
    """Every non-active target's parts of ``st``, by tokenizer hash (:func:`target_part`)."""
    active = active_target(st.meta)[0]
    return {h: target_part(st, h) for h in target_names(st.meta) if h != active}


def with_targets(st: SavedState, parts: dict[str, tuple[str | None, SavedState]]) -> SavedState:
    """``st`` (the active target's parts at the top level) with other targets' ``parts``
    (tokenizer hash -> (name, parts in the top-level layout)) filed under ``targets.<hash12>.``."""
    meta, tensors = dict(st.meta), dict(st.tensors)
    section = {}
    for h, (name, part) in parts.items():
        key = target_key(h)
        section[key] = {**{k: v for k, v in part.meta.items() if k not in ("name", "tokenizer")},
                        "name": name, "tokenizer": h}
        tensors.update({f"{TARGETS}.{key}.{k}": v for k, v in part.tensors.items()})
    if section:
        meta[TARGETS] = section
    return SavedState(meta, tensors, st.rows, st.weights_version)


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
