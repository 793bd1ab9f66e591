"""RunContext on its own, without models: what a run directory holds whatever happens."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from omnidraft.errors import OmniDraftError
from omnidraft.lifecycle import RunContext, check_resume, fingerprint


def _cfg(tmp_path, **kw):
    return OmegaConf.create({"run_dir": str(tmp_path / "run"), "seed": 0, "threads": None, "resume": False,
                             "checkpoint_every": 2, "logger": None, "paths": {"cache_dir": str(tmp_path / "c")},
                             "method": {"k": 3}, **kw})


def test_a_run_that_raises_keeps_its_provenance_and_a_failed_summary(tmp_path):
    ctx = RunContext(_cfg(tmp_path), ["method.k=3"])
    ctx.fresh()
    log = ctx.open_log()
    rows = []
    with pytest.raises(RuntimeError, match="boom"), ctx.finishing(lambda status: {"status": status, "n": len(rows)}):
        for i in range(3):
            if i == 2:
                raise RuntimeError("boom")
            rows.append({"x": i})
            log.log(rows[-1], step=i)
    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text()) == {"status": "failed: RuntimeError: boom", "n": 2}
    assert json.loads((run / "provenance.json").read_text())["overrides"] == ["method.k=3"]
    assert (run / "config.yaml").exists() and not (run / "summary.json.tmp").exists()
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 0, "x": 0}, {"step": 1, "x": 1}]
    assert [s["start"] for s in ctx.prov["segments"]] == [0] and ctx.resumed_at is None


def test_resume_rewrites_the_log_up_to_the_checkpoint_and_fresh_drops_it(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    ctx = RunContext(cfg, [])
    ctx.resume(1, [{"start": 0}], [(0, {"x": 0})])
    assert (ctx.start, ctx.resumed_at) == (1, 1)
    assert [s["start"] for s in ctx.prov["segments"]] == [0, 1] and ctx.segments is ctx.prov["segments"]
    with ctx.finishing(lambda status: {"status": status}):
        ctx.open_log().log({"x": 1}, step=1)
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 0, "x": 0}, {"step": 1, "x": 1}]
    assert ctx.summary == {"status": "ok"} == json.loads((run / "summary.json").read_text())
    RunContext(cfg, []).fresh()
    assert not (run / "metrics.jsonl").exists()


def test_resume_refusal_names_the_first_differing_key_and_ignores_free_ones(tmp_path):
    saved = fingerprint(_cfg(tmp_path))
    check_resume(_cfg(tmp_path, progress=True, checkpoint_every=5), saved, "from x", "advice")
    with pytest.raises(OmniDraftError, match=r"^cannot resume from x: the config differs "
                                             r"\(method.k: saved 3, now 4\); advice$"):
        check_resume(_cfg(tmp_path, method={"k": 4}), saved, "from x", "advice")


def test_checkpoints_every_n_items_and_after_the_last(tmp_path):
    ctx = RunContext(_cfg(tmp_path), [])
    assert [i for i in range(5) if ctx.checkpoint_due(i, 5)] == [1, 3, 4]


def test_archive_checksums_do_not_change_a_cells_identity():
    from omegaconf import OmegaConf

    from omnidraft.lifecycle import fingerprint

    base = {"target": {"name": "t", "gguf": {"sha256": "a" * 64}}, "drafter": None, "seed": 0}
    pinned = {**base, "target": {"name": "t", "gguf": {"sha256": "a" * 64, "artifact_sha256": ["b" * 64]}}}
    assert fingerprint(OmegaConf.create(base)) == fingerprint(OmegaConf.create(pinned))
    other = {**base, "target": {"name": "t", "gguf": {"sha256": "c" * 64}}}
    assert fingerprint(OmegaConf.create(base)) != fingerprint(OmegaConf.create(other))


def test_archive_checksums_do_not_change_a_traces_identity(tmp_path):
    """A trace taken before the model wheels were pinned continues under the pinned config."""
    from conftest import compose_run

    from omnidraft.lifecycle import resolve_dtypes
    from omnidraft.trace import trace_identity

    def ident(*over):
        cfg = compose_run(tmp_path, "r", ["task=gsm8k"], *over)
        resolve_dtypes(cfg)
        return trace_identity(cfg)

    pinned = ident()
    assert len(OmegaConf.to_container(compose_run(tmp_path, "r", [])).get("target")["gguf"]["artifact_sha256"]) > 0
    assert pinned == ident("target.gguf.artifact_sha256=[]")
    assert pinned != ident("target.gguf.sha256=" + "0" * 64)
