"""The import layers (README "Architecture"): a layer imports only the layers below it.

base (errors, choices, state, provenance) < core (decode loop, verification, KV, feedback, verifiers)
< drafting (drafters, direct map, n-gram cache) < learn (observers that learn); data beside them.
Only the top (cli, config, lifecycle, runner, bench, tables, api, ...) sees the Hydra config.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "omnidraft"
BASE = {"errors", "choices", "state", "provenance"}  # leaves: stdlib, torch, safetensors only
ALLOWED = {  # subpackage -> the omnidraft modules/subpackages it may import
    "core": BASE | {"core"},
    "drafting": BASE | {"core", "drafting"},
    "learn": BASE | {"core", "drafting", "learn"},
    "data": BASE | {"data"},
}
FORBIDDEN_THIRD_PARTY = ("hydra", "omegaconf", "wandb")


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names), at any depth of the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == "omnidraft":
                out |= {f"omnidraft.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below(layer):
    bad = []
    for f in sorted((PKG / layer).glob("*.py")):
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] == "omnidraft" and len(parts) > 1 and parts[1] not in ALLOWED[layer]:
                bad.append(f"{f.name} imports {mod}")
            if parts[0] in FORBIDDEN_THIRD_PARTY:
                bad.append(f"{f.name} imports {mod}")
    assert not bad, bad


def test_drafters_import_no_learner():
    for f in (PKG / "drafting").glob("*.py"):
        assert not any(m.startswith("omnidraft.learn") for m in _imports(f)), f.name


def test_importing_the_library_layers_loads_no_config_or_logging_framework():
    """Transitively too: importing every module of core, drafting, learn and data leaves hydra,
    omegaconf and wandb unloaded."""
    mods = [f"omnidraft.{layer}.{f.stem}" for layer in ALLOWED for f in sorted((PKG / layer).glob("*.py"))
            if f.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FORBIDDEN_THIRD_PARTY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
