"""Where the time goes: wall time inside model forward passes, measured with PyTorch's public
module hooks (no patching). ``overhead = 1 - forward_s / wall_s`` is the framework's share: Python
work, re-tokenisation, mask building, verification arithmetic, cache bookkeeping."""

from __future__ import annotations

import resource
import time

import torch


class ForwardTimer:
    """Accumulates wall seconds spent in the top-level forward of the given models.

    Use as a context manager; hooks are removed on exit. Nested calls of the same model (a model
    calling itself) are counted once. On CUDA the hooks synchronise so the times are real.
    """

    def __init__(self, models: list[torch.nn.Module]):
        self.models = [m for m in models if m is not None]
        self.forward_s = 0.0
        self.calls = 0
        self._depth = 0
        self._t0 = 0.0
        self._handles = []

    def _sync(self, module) -> None:
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "cuda":
            torch.cuda.synchronize(p.device)

    def _pre(self, module, args):
        if self._depth == 0:
            self._sync(module)
            self._t0 = time.perf_counter()
        self._depth += 1

    def _post(self, module, args, out):
        self._depth -= 1
        if self._depth == 0:
            self._sync(module)
            self.forward_s += time.perf_counter() - self._t0
            self.calls += 1

    def __enter__(self) -> "ForwardTimer":
        for m in self.models:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def rss_gib() -> float:
    """Current resident set size of this process (GiB), from /proc where available."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return peak_rss_gib()


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
