"""Checks and builds for config nodes with ``_target_`` (no Hydra imports beyond its utils)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig

from omnidraft.errors import OmniDraftError


def iter_targets(node: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """All (dotted path, node) pairs of sub-nodes that carry a ``_target_``. A node that is an
    interpolation of another (``targets: ${target_switch.schedules.x}``) is visited where it points."""
    if isinstance(node, (DictConfig, ListConfig)) and (node._is_none() or node._is_missing()
                                                       or node._is_interpolation()):
        return
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for k in node.keys():
            v = node._get_node(k)
            if isinstance(v, (DictConfig, ListConfig)):
                yield from iter_targets(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            if isinstance(v, (DictConfig, ListConfig)):
                yield from iter_targets(v, f"{path}[{i}]")


def import_target(dotted: str):
    mod, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise OmniDraftError(f"_target_ {dotted!r} cannot be imported ({e}); fix the config") from None


def accepted(sig: inspect.Signature, names) -> set[str]:
    """The subset of ``names`` a callable accepts as keywords."""
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(names)
    return {n for n in names if n in sig.parameters}


def call_with(fn, **available):
    """Call ``fn`` (e.g. a functools.partial from Hydra) with the runtime objects it accepts."""
    return fn(**{k: available[k] for k in accepted(inspect.signature(fn), available)})


def check_targets(cfg: DictConfig, runtime: dict[str, set[str]] | None = None) -> int:
    """Bind every ``_target_``'s configured kwargs to its signature, without building anything.

    Args:
        runtime: dotted path -> names of arguments the runner supplies at build time; they count as
            bound for the check, and every required argument must then be bound. Other nodes marked
            ``_partial_`` may leave arguments unbound.
    Returns:
        the number of nodes checked.
    """
    runtime = runtime or {}
    n = 0
    for path, node in iter_targets(cfg):
        fn = import_target(node["_target_"])
        kwargs = {k: None for k in node.keys() if not str(k).startswith("_")}
        sig = inspect.signature(fn)
        kwargs.update({k: None for k in accepted(sig, runtime.get(path, set()))})
        try:
            if node.get("_partial_", False) and path not in runtime:
                sig.bind_partial(**kwargs)
            else:
                sig.bind(**kwargs)
        except TypeError as e:
            raise OmniDraftError(f"config node {path!r} ({node['_target_']}): {e}; fix its keys") from None
        n += 1
    return n
