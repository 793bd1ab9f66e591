"""The packaged evaluate modules load offline and compute what the runner's quality keys compute."""

from __future__ import annotations

import json

import pytest

from omnidraft.data.quality import exact_match, rouge
from omnidraft.data.tasks import load_task
from omnidraft.metrics import load

pytest.importorskip("evaluate")


def test_gsm8k_exact_match_and_rouge_match_the_row_keys(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    preds, refs = ["so 9 * 2 = $18.\n#### 18", "It is 17.", "The answer is 1,234.5"], ["18", "18", "1234.5"]
    got = load("gsm8k_exact_match").compute(predictions=preds, references=refs)
    assert got["exact_match"] == pytest.approx(sum(exact_match(p, r) for p, r in zip(preds, refs)) / 3) == 2 / 3
    s, r = ["a cat sat on the mat today", "the dog barked"], ["the cat sat on a mat", "a dog was barking loudly"]
    got = load("summary_rouge").compute(predictions=s, references=r)
    assert got["rouge1"] == pytest.approx((rouge(s[0], r[0])["quality/rouge1"] + rouge(s[1], r[1])["quality/rouge1"]) / 2)


def test_code_pass_at_1_runs_the_tests_in_the_sandbox(monkeypatch):
    from omnidraft.data.artifacts import default_cache_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    h = load_task("humaneval", "auto", default_cache_dir())[0]
    ref = json.dumps({"task": "humaneval", **h.metadata})
    good = f"```python\n{h.metadata['prompt']}{h.reference}```"
    bad = "```python\ndef has_close_elements(a, b):\n    return 0\n```"
    got = load("code_pass_at_1").compute(predictions=[good, bad], references=[ref, ref], timeout=5)
    assert got["pass@1"] == 0.5
