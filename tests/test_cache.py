"""The download and conversion cache: a cut archive is deleted and fetched once more, a damaged
cache entry is rebuilt rather than trusted by its marker, and processes filling one entry at the
same time neither collide nor see half-written files."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
import zipfile
from pathlib import Path

import pytest

from omnidraft.data import artifacts, models
from omnidraft.data.artifacts import Member, assemble, download_artifact
from omnidraft.errors import OmniDraftError


def _wheel(path: Path, member: str, payload: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def _fake_registry(monkeypatch, payload: bytes, calls: list):
    """pip download replaced by writing a good wheel (no network in tests)."""
    def fetch(package, version, dist, dest, sha256):
        calls.append(package)
        dest.mkdir(parents=True, exist_ok=True)
        good = _wheel(dest / f"{package}-{version}-py3-none-any.whl", "pkg/data.bin", payload)
        artifacts._check(good, sha256)
        return good
    monkeypatch.setattr(artifacts, "_fetch", fetch)


def test_a_cut_archive_with_a_pinned_checksum_is_fetched_once_more(tmp_path, monkeypatch):
    calls: list = []
    _fake_registry(monkeypatch, b"x" * 1000, calls)
    good = _wheel(tmp_path / "good.whl", "pkg/data.bin", b"x" * 1000)
    sha = artifacts.sha256_file(good)
    dest = tmp_path / "cache" / "registry" / "fake-1.0-wheel"
    cut = dest / "fake-1.0-py3-none-any.whl"
    dest.mkdir(parents=True)
    cut.write_bytes(good.read_bytes()[:300])  # a download cut short, left in the cache
    got = download_artifact("fake", "1.0", "wheel", tmp_path / "cache", sha)
    assert calls == ["fake"] and artifacts.sha256_file(got) == sha
    assert download_artifact("fake", "1.0", "wheel", tmp_path / "cache", sha) == got and calls == ["fake"]


def test_a_cut_archive_without_a_pin_is_fetched_once_more_when_it_cannot_be_read(tmp_path, monkeypatch):
    calls: list = []
    payload = b"y" * 5000
    _fake_registry(monkeypatch, payload, calls)
    dest = tmp_path / "cache" / "registry" / "fake-1.0-wheel"
    dest.mkdir(parents=True)
    good = _wheel(tmp_path / "good.whl", "pkg/data.bin", payload)
    (dest / "fake-1.0-py3-none-any.whl").write_bytes(good.read_bytes()[:200])
    out = assemble([Member("fake", "1.0", "pkg/data.bin")], tmp_path / "cache" / "out.bin",
                   hashlib.sha256(payload).hexdigest(), tmp_path / "cache")
    assert out.read_bytes() == payload and calls == ["fake"]
    out.write_bytes(b"damaged")  # an assembled file that no longer matches is rebuilt, not trusted
    assert assemble([Member("fake", "1.0", "pkg/data.bin")], out, hashlib.sha256(payload).hexdigest(),
                    tmp_path / "cache").read_bytes() == payload


def test_an_archive_damaged_twice_ends_in_one_line(tmp_path, monkeypatch):
    def fetch(package, version, dist, dest, sha256):
        dest.mkdir(parents=True, exist_ok=True)
        bad = dest / f"{package}-{version}-py3-none-any.whl"
        bad.write_bytes(b"PK\x03\x04 not a zip")
        return bad
    monkeypatch.setattr(artifacts, "_fetch", fetch)
    with pytest.raises(OmniDraftError, match="damaged .* even after a fresh download"):
        assemble([Member("fake", "1.0", "pkg/data.bin")], tmp_path / "out.bin", None, tmp_path)


def _copy_vocab_cache(dst: Path) -> None:
    src = artifacts.default_cache_dir() / "vocab"
    if not src.is_dir():
        models.load_vocab_tokenizer("llama-spm", artifacts.default_cache_dir())
    shutil.copytree(src, dst / "vocab")


def test_a_converted_entry_is_checked_against_its_recorded_hashes(tmp_path):
    _copy_vocab_cache(tmp_path)
    tok = models.load_vocab_tokenizer("llama-spm", tmp_path)
    saved = next((tmp_path / "tokenizers").iterdir())
    marker = json.loads((saved / "omnidraft_source.json").read_text())
    assert "tokenizer.json" in marker["files"]
    assert models._verified(saved, saved / "omnidraft_source.json")
    with open(saved / "tokenizer.json", "r+b") as f:  # one byte changed, same size
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    assert not models._verified(saved, saved / "omnidraft_source.json")
    again = models.load_vocab_tokenizer("llama-spm", tmp_path)  # rebuilt, not trusted
    assert again.encode("Hello world") == tok.encode("Hello world")
    assert models._verified(saved, saved / "omnidraft_source.json")


def _load(cache: str, q) -> None:
    try:
        tok = models.load_vocab_tokenizer("llama-spm", Path(cache))
        q.put(tok.encode(" hello\n  world"))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put(repr(e))


def test_processes_filling_one_entry_at_once_do_not_collide(tmp_path):
    _copy_vocab_cache(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_load, args=(str(tmp_path), q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(g == got[0] and isinstance(g, list) for g in got), got
    leftovers = [p.name for p in (tmp_path / "tokenizers").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def test_an_sdist_is_fetched_as_a_file_never_built(tmp_path, monkeypatch):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"vocab bytes"
        info = tarfile.TarInfo("fake_pkg-1.0/data/vocab.gguf")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
        setup = b"raise SystemExit('the build backend ran')"
        info = tarfile.TarInfo("fake_pkg-1.0/setup.py")
        info.size = len(setup)
        tf.addfile(info, io.BytesIO(setup))
    src = tmp_path / "index" / "fake_pkg-1.0.tar.gz"
    src.parent.mkdir()
    src.write_bytes(buf.getvalue())
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    monkeypatch.setattr(artifacts, "_index_files", lambda package: [
        ("fake_pkg-0.9.tar.gz", "file:///nonexistent", None), ("fake_pkg-1.0.tar.gz", src.as_uri(), sha)])

    def no_pip(*a, **k):
        raise AssertionError(f"pip ran: {a}")
    monkeypatch.setattr(artifacts.subprocess, "run", no_pip)
    out = assemble([Member("fake-pkg", "1.0", "fake_pkg-1.0/data/vocab.gguf", "sdist", sha)], tmp_path / "v.gguf",
                   hashlib.sha256(b"vocab bytes").hexdigest(), tmp_path / "cache")
    assert out.read_bytes() == b"vocab bytes"
    with pytest.raises(OmniDraftError, match="checksum mismatch"):  # a pin the index's file does not match
        download_artifact("fake-pkg", "1.0", "sdist", tmp_path / "cache2", "0" * 64)


def test_a_cache_dir_with_a_tilde_is_the_home_directorys(tmp_path, monkeypatch):
    """A run's portable config.yaml keeps paths.cache_dir as '~/.cache/omnidraft': loading from it
    must use the home directory's cache, not make a literal './~' directory."""
    from conftest import compose_run

    from omnidraft.data.models import load_model
    from omnidraft.data.tasks import load_stream
    from omnidraft.lifecycle import to_plain

    monkeypatch.chdir(tmp_path)
    cfg = compose_run(tmp_path, "r", ["debug=tiny"])
    load_model(to_plain(cfg.target), "~/.cache/omnidraft")
    load_stream(to_plain(cfg.task), "~/.cache/omnidraft")
    assert not (tmp_path / "~").exists()
