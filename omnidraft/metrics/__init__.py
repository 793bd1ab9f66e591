"""The task quality metrics as ``evaluate`` modules shipped inside the package: load them the way any
evaluate metric loads, offline (a local module needs no hub).

    from omnidraft.metrics import load
    em = load("gsm8k_exact_match")
    em.compute(predictions=["... so 18 in all. #### 18"], references=["18"])   # {"exact_match": 1.0}
    load("code_pass_at_1").compute(predictions=[answer], references=[{"task": "humaneval", **record.metadata}])
    load("summary_rouge").compute(predictions=[summary], references=[reference])

Each wraps the same function the runner scores rows with (:mod:`omnidraft.data.quality`), so a
number from ``evaluate`` and a ``quality/*`` key in a row are the same computation.
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("gsm8k_exact_match", "code_pass_at_1", "summary_rouge")


def path(name: str) -> str:
    """The directory of metric ``name`` (what ``evaluate.load`` takes)."""
    if name not in NAMES:
        from omnidraft.errors import OmniDraftError

        raise OmniDraftError(f"unknown metric {name!r}; use one of {', '.join(NAMES)}")
    return str(Path(__file__).resolve().parent / name)


def load(name: str, **kwargs):
    """``evaluate.load`` of the packaged metric ``name``."""
    import evaluate

    return evaluate.load(path(name), **kwargs)
