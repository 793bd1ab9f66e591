"""Task quality metrics, per prompt (one turn's output), named ``quality/*``.

GSM8K exact match of the final number; HumanEval / MBPP pass@1 by running the code against the
tests in :mod:`omnidraft.data.sandbox` (only when the run opts in); XSum ROUGE-1/2/L F1 (rouge-score);
MT-Bench and Alpaca: output length in tokens. Equality with the ``ar`` output is reported for every
task by the runner (``lossless/match``).
"""

from __future__ import annotations

import re
from typing import Any

from omnidraft.data.tasks import Record

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FENCE = re.compile(r"```(?:[Pp]ython3?|py)?[^\n]*\n(.*?)(?:```|$)", re.S)


def _to_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The answer number of a GSM8K-style solution: after '####' or 'answer is', else the last number."""
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            m = _NUM.search(text.rsplit(marker, 1)[1])
            if m:
                return _to_number(m.group())
    nums = _NUM.findall(text.replace("$", ""))
    return _to_number(nums[-1]) if nums else None


def exact_match(output: str, reference: str | None) -> float:
    ref = _to_number(str(reference)) if reference is not None else None
    got = final_number(output)
    return float(ref is not None and got is not None and abs(got - ref) < 1e-6)


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer, or the text itself."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def humaneval_program(output: str, meta: dict[str, Any]) -> str:
    """Prompt + completion, or the model's complete function (with the prompt's imports), + tests."""
    code = extract_code(output)
    if f"def {meta['entry_point']}" in code:
        imports = "\n".join(x for x in meta["prompt"].splitlines() if x.startswith(("import ", "from ")))
        body = imports + "\n" + code
    else:
        body = meta["prompt"] + code
    return f"{body}\n\n{meta['test']}\n\ncheck({meta['entry_point']})\n"


def mbpp_program(output: str, meta: dict[str, Any]) -> str:
    return "\n".join([meta.get("test_setup_code") or "", extract_code(output), *meta["test_list"], ""])


_ROUGE = None


def rouge(output: str, reference: str) -> dict[str, float]:
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    s = _ROUGE.score(reference, output)
    return {f"quality/{k}": v.fmeasure for k, v in s.items()}


def score(record: Record, turn: int, output: str, n_tokens: int, *, execute_code: bool = False,
          timeout: float = 10.0, memory_mb: int = 1024) -> dict[str, Any]:
    """Quality keys for one decoded turn of ``record`` (by ``record.metadata['task']``)."""
    task = record.metadata.get("task")
    out: dict[str, Any] = {"quality/len": n_tokens}
    if task in ("mt_bench", "alpaca", "alpaca_sample", "synthetic"):
        out["quality/mean_len"] = n_tokens
    elif turn > 0:
        pass
    elif task == "gsm8k":
        out["quality/exact_match"] = exact_match(output, record.reference)
    elif task == "xsum" and record.reference:
        out.update(rouge(output, record.reference))
    elif task in ("humaneval", "mbpp"):
        out["quality/executed"] = bool(execute_code)
        if execute_code:
            from omnidraft.data.sandbox import run_program

            prog = humaneval_program(output, record.metadata) if task == "humaneval" else mbpp_program(output, record.metadata)
            res = run_program(prog, timeout=timeout, memory_mb=memory_mb)
            out["quality/pass@1"] = float(res.passed)
            out["quality/exec_status"] = res.status
            out["quality/exec_detail"] = res.detail
            out["quality/exec_confinement"] = ",".join(res.confinement) or "none"
    return out


def summarise_quality(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means of the numeric quality keys over the rows that have them (pass@1 with one sample per
    problem is the fraction passed)."""
    keys = sorted({k for r in rows for k, v in r.items() if k.startswith("quality/")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        out[k] = sum(vals) / len(vals)
        out[f"{k}_n"] = len(vals)
    return out
