"""``omnidraft trace`` on a tiny target: the trace is the target's greedy output, a cut or extended
trace equals an uninterrupted one, and every damaged or mismatched trace is one clear line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF_DIR, PROMPTS, eos_of, one_error_line
from hydra import compose, initialize_config_dir

from omnidraft.config import register_configs
from omnidraft.core.decode import generate
from omnidraft.data.models import load_model
from omnidraft.data.tasks import format_prompt, load_stream, render
from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import resolve_dtypes, to_plain
from omnidraft.trace import (
    LINES_FILE,
    check_trace,
    check_trace_config,
    compare_traces,
    greedy_batch,
    read_trace,
    request_for,
    run_trace,
    trace_dir,
)

TINY = ["target=tiny_qwen2", "task=synthetic", "decode.max_new_tokens=16", "logger=none", "progress=false"]


def _cfg(tmp_path, *over, name="tr"):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("trace", overrides=[f"run_dir={tmp_path}/run_{name}", f"trace.out_dir={tmp_path}/{name}",
                                           *TINY, *over])


def _trace(tmp_path, *over, name="tr"):
    return run_trace(_cfg(tmp_path, *over, name=name))


def _content(d: Path) -> list[dict]:
    """The trace's lines less what is not its identity (timings; the checksum covers them)."""
    return [{k: v for k, v in dataclasses.asdict(ln).items() if k != "wall_s"} for ln in read_trace(d).lines]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """An uninterrupted trace of 5 synthetic prompts, its config and target."""
    tmp = tmp_path_factory.mktemp("trace")
    cfg = _cfg(tmp, "task.limit=5", name="full")
    s = run_trace(cfg)
    target = load_model(to_plain(cfg.target), Path(cfg.paths.cache_dir))
    return tmp, cfg, s, target


def test_trace_is_the_targets_greedy_output(traced):
    tmp, cfg, s, target = traced
    assert s["status"] == "ok" and s["n_lines"] == s["n_added"] == 5 and s["resumed_at"] is None
    tr = read_trace(tmp / "full")
    records = load_stream(to_plain(cfg.task), Path(cfg.paths.cache_dir))
    assert [(ln.index, ln.turn, ln.id) for ln in tr.lines] == [(i, 0, r.id) for i, r in enumerate(records)]
    for ln, r in zip(tr.lines, records):
        ids = format_prompt(target.tokenizer, render(r, 0, {}), use_chat_template=True)
        assert ln.prompt_ids == ids  # the stream runner's prompt construction
        res = generate(target.model, ids, drafter=None, max_new_tokens=16, eos_ids=target.eos_ids)
        assert ln.output_ids == res.tokens and ln.stop == res.stop and ln.wall_s > 0
        assert len(ln.output_ids) <= 16
    ident = tr.identity
    assert ident["max_new_tokens"] == 16 and ident["target"]["dtype"] == "float32"
    assert ident["target"]["tokenizer_hash"] and ident["target"]["chat_template"] is True
    seg = tr.meta["segments"]
    assert len(seg) == 1 and seg[0]["task_limit"] == 5 and "git_hash" in seg[0] and "cpu" in seg[0]
    # the run directory's files (RunContext): one timing row per line
    rows = [json.loads(x) for x in (tmp / "run_full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["prompt/index"] for r in rows] == list(range(5))
    assert json.loads((tmp / "run_full" / "summary.json").read_text())["n_lines"] == 5


def test_cut_and_extended_trace_equals_uninterrupted(traced, tmp_path):
    full = _content(traced[0] / "full")
    s = _trace(tmp_path, "task.limit=2")
    assert s["n_added"] == 2
    s = _trace(tmp_path, "task.limit=4")  # a larger limit: the 2 traced prompts are skipped
    assert s["n_added"] == 2 and s["resumed_at"] == 2 and s["n_lines"] == 4
    f = tmp_path / "tr" / LINES_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 40])  # cut while writing the 4th line
    s = _trace(tmp_path, "task.limit=5")
    assert s["n_added"] == 2 and s["resumed_at"] == 3  # the half-written line is redone
    assert _content(tmp_path / "tr") == full
    meta = read_trace(tmp_path / "tr").meta
    assert [g["start"] for g in meta["segments"]] == [0, 2, 3]
    rows = (tmp_path / "run_tr" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt/index"] for x in rows] == list(range(5))
    before = {n: (tmp_path / n).read_bytes() for n in ("tr/meta.json", "tr/trace.jsonl", "run_tr/summary.json")}
    again = _trace(tmp_path, "task.limit=5")  # complete: nothing to do, and nothing is written
    assert again["status"] == "ok" and again["n_added"] == 0 and again["n_lines"] == 5 and again["complete"]
    assert {n: (tmp_path / n).read_bytes() for n in before} == before


def _by_key(lines: list[dict]) -> list[dict]:
    return sorted(lines, key=lambda d: (d["index"], d["turn"]))


@pytest.mark.parametrize("fixture", ["qwen_tiny", "llama3_tiny"])
def test_greedy_batch_is_each_prompts_own_greedy_output(fixture, request):
    """Decoded together (left-padded to one length), each prompt gets the tokens it gets alone,
    and a row that reaches EOS stops there while the others go on."""
    model, tok = request.getfixturevalue(fixture)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:6]]
    assert len({len(p) for p in prompts}) > 3  # padding is exercised
    alone = generate(model, prompts[0], drafter=None, max_new_tokens=12, eos_ids=eos_of(tok))
    for eos in (eos_of(tok), {alone.tokens[3]}):  # the second: prompt 0 ends at its 4th token
        outs = greedy_batch(model, prompts, 12, eos, pad_id=0)
        for p, (out, stop) in zip(prompts, outs):
            res = generate(model, p, drafter=None, max_new_tokens=12, eos_ids=eos)
            assert out == res.tokens and stop == res.stop
    assert outs[0][1] == "eos" and len(outs[0][0]) <= 4 and any(len(o) == 12 for o, _ in outs)


def test_batched_trace_equals_one_by_one(traced, tmp_path):
    """trace.batch_size > 1 writes the lines a one-by-one trace writes (in length order), continues a
    cut trace the same way, and records each run's batch size."""
    full = _by_key(_content(traced[0] / "full"))
    s = _trace(tmp_path, "task.limit=2", "trace.batch_size=3")
    assert s["n_added"] == 2
    s = _trace(tmp_path, "task.limit=5", "trace.batch_size=2")  # the 3 left, in two batches
    assert s["n_added"] == 3 and s["n_lines"] == 5 and s["resumed_at"] == 2
    assert _by_key(_content(tmp_path / "tr")) == full
    assert [g["batch_size"] for g in read_trace(tmp_path / "tr").meta["segments"]] == [3, 2]
    assert all(ln.wall_s > 0 for ln in read_trace(tmp_path / "tr").lines)
    report = compare_traces(read_trace(traced[0] / "full"), read_trace(tmp_path / "tr"))
    assert report["identical_lines"] == report["lines"] == 5 and report["differing"] == []
    assert report["a"]["batch_sizes"] == [1] and report["b"]["batch_sizes"] == [2, 3]
    late = compare_traces(read_trace(traced[0] / "full"), dataclasses.replace(
        read_trace(tmp_path / "tr"), by_key={k: v for k, v in read_trace(tmp_path / "tr").by_key.items() if k[0] >= 2}))
    assert late["lines"] == 3 and late["b"]["batch_sizes"] == [2]  # the lines the second run wrote


def test_compare_traces_finds_the_first_differing_token(traced, tmp_path):
    a = read_trace(traced[0] / "full")
    b = read_trace(traced[0] / "full")
    line = b.by_key[(3, 0)]
    b.by_key[(3, 0)] = dataclasses.replace(line, output_ids=line.output_ids[:5] + [line.output_ids[5] + 1])
    del b.by_key[(4, 0)]  # only the lines both hold are compared
    r = compare_traces(a, b)
    assert r["lines"] == 4 and r["identical_lines"] == 3 and r["differing"] == [
        {"index": 3, "turn": 0, "first_difference_at": 5}]
    assert r["tokens_before_first_difference"] == r["tokens"] - len(line.output_ids) + 5
    b.by_key[(0, 0)] = dataclasses.replace(b.by_key[(0, 0)], prompt_ids=[1, 2, 3])
    with pytest.raises(OmniDraftError, match="index 0 turn 0: the two traces hold different prompts"):
        compare_traces(a, b)


def test_changed_config_is_refused_before_loading(traced):
    tmp = traced[0]
    before = (tmp / "full" / LINES_FILE).read_bytes()
    with pytest.raises(OmniDraftError, match=r"max_new_tokens: saved 16, now 8") as e:
        run_trace(_cfg(tmp, "task.limit=5", "decode.max_new_tokens=8", name="full"))
    assert "\n" not in str(e.value) and "trace.out_dir" in str(e.value)
    with pytest.raises(OmniDraftError, match=r"task.system_prompt: saved None, now 'Be brief.'"):
        run_trace(_cfg(tmp, "task.limit=5", "task.system_prompt=Be brief.", name="full"))
    assert (tmp / "full" / LINES_FILE).read_bytes() == before


def _damaged(tmp_path, src: Path, edit) -> Path:
    d = tmp_path / "damaged"
    d.mkdir()
    (d / "meta.json").write_bytes((src / "meta.json").read_bytes())
    lines = (src / LINES_FILE).read_bytes().split(b"\n")[:-1]
    (d / LINES_FILE).write_bytes(edit(lines))
    return d


@pytest.mark.parametrize("edit,needle", [
    (lambda ls: b"\n".join(ls[:1] + [ls[1].replace(b'"turn":0', b'"turn":1')] + ls[2:]) + b"\n",
     ":2: corrupt trace line (checksum mismatch)"),
    (lambda ls: b"\n".join(ls[:2] + [ls[2][:30]] + ls[3:]) + b"\n", ":3: corrupt trace line"),
    (lambda ls: b"\n".join(ls[:3]) + b"\n" + ls[3][:50], ":4: truncated trace line"),
    (lambda ls: b"\n".join(ls[:2] + ls[1:2]) + b"\n", ":3: duplicate trace line for index 1 turn 0 (first at line 2)"),
])
def test_damaged_trace_is_one_line_with_file_and_line(traced, tmp_path, edit, needle):
    d = _damaged(tmp_path, traced[0] / "full", edit)
    with pytest.raises(OmniDraftError) as e:
        read_trace(d)
    msg = str(e.value)
    assert msg.startswith(str(d / LINES_FILE)) and needle in msg and "\n" not in msg, msg


def test_corrupt_line_is_refused_when_continuing(traced, tmp_path):
    """Only a half-written LAST line is redone; a corrupt complete line stops the command."""
    _damaged(tmp_path, traced[0] / "full",
             lambda ls: b"\n".join(ls[:1] + [ls[1].replace(b'"turn":0', b'"turn":2')] + ls[2:]) + b"\n")
    with pytest.raises(OmniDraftError, match=r"trace.jsonl:2: corrupt trace line"):
        _trace(tmp_path, "task.limit=5", name="damaged")


def test_check_trace_accepts_a_matching_trace_and_refuses_the_rest(traced, tmp_path):
    tmp, _, _, target = traced
    tr = read_trace(tmp / "full")

    def want(*over):
        cfg = _cfg(tmp, *over, name="full")
        resolve_dtypes(cfg)
        records = load_stream(to_plain(cfg.task), Path(cfg.paths.cache_dir))
        first = [format_prompt(target.tokenizer, render(r, 0, {}), system=cfg.task.system_prompt,
                               use_chat_template=cfg.target.chat_template) for r in records]
        return request_for(cfg, target.tokenizer, records, first)

    check_trace(tr, want("task.limit=5"))
    check_trace(tr, want("task.limit=3", "decode.max_new_tokens=8"))  # fewer tokens: a prefix replays
    check_trace(tr, want("task.offset=2", "task.limit=3"))  # a window of the traced stream

    def refused(req, *needles):
        with pytest.raises(OmniDraftError) as e:
            check_trace(tr, req)
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg

    refused(want("task.limit=5", "decode.max_new_tokens=32"),
            "at most 16 new tokens", "decode.max_new_tokens=32", "omnidraft trace")
    refused(want("task.limit=7"), "lacks 2 of this run's 7 prompts", "5 'synthetic-5'", "6 'synthetic-6'",
            "make them with: omnidraft trace")
    refused(want("task.limit=5", "target.dtype=bfloat16"), "decoded in float32", "runs bfloat16")
    refused(want("task.limit=5", "target.chat_template=false"), "target.chat_template=True")
    refused(want("task.limit=5", "task.system_prompt=Be brief."), "another task stream", "task.system_prompt")
    req = want("task.limit=5")
    refused(dataclasses.replace(req, tokenizer_hash="0" * 64), "another target tokenizer")
    refused(dataclasses.replace(req, prompts=[dataclasses.replace(req.prompts[1], id="other")]),
            "holds record 'synthetic-1' at stream index 1", "'other'")
    refused(dataclasses.replace(req, prompts=[dataclasses.replace(req.prompts[0], prompt_ids=(1, 2))]),
            "the prompt of record 'synthetic-0'")
    short = want("task.limit=3", "decode.max_new_tokens=8")  # a later turn's prompt holds the earlier answer
    refused(dataclasses.replace(short, prompts=[dataclasses.replace(p, turns=2) for p in short.prompts]),
            "multi-turn prompts replay only at the trace's length", "decode.max_new_tokens=16")


def test_two_turn_prompts_resume_mid_record(tmp_path):
    """The second turn is sent with the first answer, as the stream runner does; a trace cut
    between the two turns of a record continues with the second (history rebuilt from the line)."""
    data = tmp_path / "two_turns.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"Name a colour number {i}.", "And another?"]}) + "\n"
                            for i in range(2)))
    over = ["task=mt_bench", "task.source=local", f"task.path={data}", "decode.max_new_tokens=8"]
    run_trace(_cfg(tmp_path, *over, name="full"))
    full = read_trace(tmp_path / "full")
    assert [(ln.index, ln.turn) for ln in full.lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    cfg = _cfg(tmp_path, *over, name="full")
    target = load_model(to_plain(cfg.target), Path(cfg.paths.cache_dir))
    answer = target.tokenizer.decode(full.lines[0].output_ids, skip_special_tokens=True)
    history = [{"role": "user", "content": "Name a colour number 0."}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "And another?"}]
    assert full.lines[1].prompt_ids == format_prompt(target.tokenizer, history)

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "meta.json").write_bytes((tmp_path / "full" / "meta.json").read_bytes())
    lines = (tmp_path / "full" / LINES_FILE).read_bytes().split(b"\n")
    (cut / LINES_FILE).write_bytes(lines[0] + b"\n" + lines[1][:20])  # record 0: turn 1 half-written
    s = run_trace(_cfg(tmp_path, *over, name="cut"))
    assert s["n_added"] == 3 and s["resumed_at"] == 1
    assert _content(cut) == _content(tmp_path / "full")
    run_trace(_cfg(tmp_path, *over, "trace.batch_size=2", name="batched"))  # first turns together, then the second
    assert _by_key(_content(tmp_path / "batched")) == _content(tmp_path / "full")

    cfg = _cfg(tmp_path, *over, name="full")
    resolve_dtypes(cfg)
    req = request_for(cfg, target.tokenizer, load_stream(to_plain(cfg.task), Path(cfg.paths.cache_dir)))
    check_trace(full, req)
    del full.by_key[(1, 1)]
    with pytest.raises(OmniDraftError, match=r"lacks 1 of this run's 2 prompts \(index 1 'q1'\)"):
        check_trace(full, req)


def test_missing_trace_and_sampling_are_refused(tmp_path):
    with pytest.raises(OmniDraftError, match="no trace in .*meta.json missing"):
        read_trace(tmp_path / "nothing")
    with pytest.raises(OmniDraftError, match=r"method.temperature=0.7 has no single trajectory"):
        check_trace_config(_cfg(tmp_path, "method.temperature=0.7"))


def test_default_trace_dir_is_under_results(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("trace", overrides=["run_dir=unused", *TINY])
    assert cfg.trace.out_dir == "results/traces/tiny_qwen2/synthetic" == str(trace_dir(cfg))
    cfg.trace.out_dir = None  # the schema's default (configs other than conf/trace.yaml) is the same
    assert trace_dir(cfg) == Path("results/traces/tiny_qwen2/synthetic")


def _cli(args, cwd):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "omnidraft", "trace", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300, check=False)


def test_cli_writes_the_default_layout_and_refuses_in_one_line(tmp_path):
    proc = _cli(["debug=tiny", "task.limit=2", "decode.max_new_tokens=8", "progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = tmp_path / "results" / "traces" / "tiny_qwen2" / "synthetic"
    for f in ("meta.json", LINES_FILE, "config.yaml", "provenance.json", "metrics.jsonl", "summary.json"):
        assert (d / f).exists(), f
    assert not (d / ".hydra").exists()
    assert len(read_trace(d).lines) == 2
    one_error_line(_cli(["debug=tiny", "task.limit=2", "decode.max_new_tokens=4"], tmp_path),
                    "cannot continue the trace", "max_new_tokens: saved 8, now 4")
    one_error_line(_cli(["debug=tiny", "method.temperature=0.5"], tmp_path), "method.temperature=0.5")


def test_a_local_task_file_is_known_by_its_content_not_its_path(tmp_path):
    """The same task file under another path continues (and serves) the trace; a file whose content
    changed under the same path is refused, naming the hash."""
    rows = "".join(json.dumps({"id": f"q{i}", "turns": [f"Count to {i}."]}) + "\n" for i in range(3))
    a, b = tmp_path / "a" / "data.jsonl", tmp_path / "b" / "copy.jsonl"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text(rows)
    over = ["task=mt_bench", "task.source=local", "decode.max_new_tokens=6"]
    run_trace(_cfg(tmp_path, *over, f"task.path={a}", "task.limit=2", name="t"))
    s = run_trace(_cfg(tmp_path, *over, f"task.path={b}", "task.limit=3", name="t"))  # moved: continues
    assert s["n_added"] == 1 and s["n_lines"] == 3
    cfg = _cfg(tmp_path, *over, f"task.path={b}", "task.limit=3", name="t")
    resolve_dtypes(cfg)
    target = load_model(to_plain(cfg.target), Path(cfg.paths.cache_dir))
    check_trace(read_trace(tmp_path / "t"), request_for(cfg, target.tokenizer,
                                                         load_stream(to_plain(cfg.task), Path(cfg.paths.cache_dir))))
    a.write_text(rows.replace("Count to 2.", "Count to 9."))  # same path, other content
    with pytest.raises(OmniDraftError, match="the config differs \\(task.path_sha256: saved"):
        run_trace(_cfg(tmp_path, *over, f"task.path={a}", "task.limit=3", name="t"))
