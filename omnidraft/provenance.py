"""Provenance of a run: code version, packages, hardware, seed, overrides."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_PACKAGES = ["omnidraft", "torch", "transformers", "tokenizers", "hydra-core", "omegaconf", "wandb",
             "datasets", "peft", "gguf", "accelerate", "safetensors", "numpy"]


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None  # leading blanks are data (status columns)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# CPU flags under which bf16 matmuls are native (x86 AVX512-BF16 / AMX, aarch64 bf16)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", *BF16_FLAGS)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, aarch64 ``Features``); empty
    where the file is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> dict[str, Any]:
    """The instruction-set facts that decide CPU speed here: bf16 is native only with
    avx512_bf16/amx_bf16; without them torch emulates it and bf16 runs several times slower."""
    flags = cpu_flags()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = None
    return {"cpu_capability": capability, "cpu_flags": [f for f in _SPEED_FLAGS if f in flags]}


def segment(prov: dict[str, Any], start: int) -> dict[str, Any]:
    """One run segment (a stream resumed later, perhaps on another machine, adds one)."""
    return {"start": start, "git_hash": prov.get("git_hash"), "git_dirty": prov.get("git_dirty"),
            "cpu": prov.get("cpu"), "cpu_capability": prov.get("cpu_capability"), "cpu_flags": prov.get("cpu_flags")}


_OUTPUT_DIRS = ("results/", "outputs/", "multirun/")


def code_dirty(porcelain: str) -> bool:
    """Whether ``git status --porcelain`` output shows an uncommitted change to the code: new or
    changed files under the output folders (results/, outputs/, multirun/: a run's own rows, a
    sweep's regenerated tables and multirun.yaml, committed cells of a table still running) do not
    count, so a sweep's runs do not all record a dirty tree."""
    for ln in porcelain.splitlines():
        path = ln[3:].split(" -> ")[-1].strip('"')  # "XY path", or "R  old -> new" for a rename
        if ln.strip() and not path.startswith(_OUTPUT_DIRS):
            return True
    return False


def collect(seed: int, overrides: list[str]) -> dict[str, Any]:
    versions = {}
    for p in _PACKAGES:
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            versions[p] = None
    status = _git("status", "--porcelain")
    return {
        "git_hash": _git("rev-parse", "HEAD"),
        "git_dirty": code_dirty(status) if status is not None else None,
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        **cpu_isa(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "seed": seed,
        "overrides": list(overrides),
        "argv": sys.argv[1:],
    }
