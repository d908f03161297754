"""Run untrusted Python programs (generated code, tool calls): one isolated process per run.

``run_program(source, stdin, limits)`` runs ``source`` under an isolated
interpreter (``python -I -S -B``: no site-packages, no user site, no
``PYTHON*`` variables; the standard library only) and returns a ``RunResult``.
``run_tests`` scores a program against APPS-style tests. Both are plain,
stateless, picklable functions, so ``ray.remote(run_tests)`` fans them out.

Each run starts ``sandbox_launcher.py`` (a supervisor that keeps the caller's
uid) in a new session with a minimal environment; the launcher isolates what
the OS allows and forks the program. ``RunResult.isolation`` names what was
enforced for that run.

Always enforced (any user, any kernel):

- resource limits per process: CPU seconds (SIGXCPU at the limit, SIGKILL one
  second later), address space (``memory_mb``; allocation fails with
  ``MemoryError``), processes (``max_processes``), file size
  (``max_file_mb``), 64 open files, no core dumps — ``"rlimits"``;
- a wall-clock timeout, after which the program and every descendant are
  killed and reaped: the launcher is a child subreaper, so even processes that
  left the session (``setsid``) or the process group are found — ``"session"``
  (without ``"uid"`` a program can kill the launcher and escape this);
- an environment reduced to PATH/LANG/LC_ALL/HOME/TMPDIR (no secret of the
  caller reaches it) — ``"environment"``;
- stdout capped at ``max_output_bytes`` (the program is stopped when it writes
  more; ``output_truncated``), stderr keeps its last ``max_output_bytes``;
- a fresh temporary directory, removed afterwards.

Enforced where the OS allows (all of them as root with CAP_SYS_ADMIN, as on
this project's machines; names in ``RunResult.isolation``):

- ``"network"``: a new, empty network namespace (not even loopback is up), so
  every connection fails, to 127.0.0.1 as well. As root directly; otherwise
  through an unprivileged user namespace when the kernel permits one. Where
  neither works (e.g. a container without CAP_SYS_ADMIN and without user
  namespaces) the network is NOT isolated.
- ``"filesystem"``: a private mount namespace in which every mount is
  read-only and nosuid, ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run`` are
  replaced by empty read-only tmpfs mounts (their sockets and files are
  invisible), and the working directory is a fresh tmpfs of ``max_disk_mb``
  at ``/tmp/work`` that vanishes with the run. A program may create a user
  namespace of its own where the kernel allows it; the mounts stay locked
  read-only there. Without ``"filesystem"`` the program runs in the host
  temporary directory and can write wherever its uid may.
- ``"proc"``: ``/proc`` remounted with ``hidepid=2``: other users' processes
  are invisible (root only; not inside a user namespace).
- ``"uid"`` (root only): the program runs under a fresh uid drawn at random
  from ``[2**30, 2**31 - 1)`` with no groups and ``no_new_privs``. Only this
  makes RLIMIT_NPROC effective (the kernel exempts root from it, and as a
  shared uid it would count the caller's processes too) and stops the program
  from signalling (killing) its caller or the launcher, or reading
  ``/proc/<pid>/environ`` of other processes. Without root the program runs
  under the caller's uid: it could kill the caller and the launcher.

Requirements: Linux >= 5.3 (``pidfd_open``); where namespaces are granted,
also >= 5.12 (``mount_setattr``), else the run raises ``SandboxError`` rather
than run with a half-built filesystem. A run costs about 45 ms (two
interpreter starts) plus the program's own time.

Not enforced: system calls are not filtered (no seccomp), so the kernel's
whole attack surface is reachable; files readable by "other" can be read
(the read-only view does not hide them); the pid namespace is shared (with
``"proc"`` other processes are hidden, not gone); CPU and memory are limited
per process, not per run (up to ``max_processes`` times each); CPU
scheduling priority is the caller's.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from reflow.envs.sandbox_launcher import kill_uid

RunStatus = Literal["ok", "error", "timeout", "memory", "killed"]

LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))
PROGRAM_FILE = "solution.py"
_CALL_FILE = "call.py"
_STDIN_FILE = "stdin.txt"
_UID_LOW, _UID_HIGH = 2**30, 2**31 - 1
_LAUNCHER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_BACKSTOP_SECONDS = 10.0  # the launcher's own start-up and clean-up, beyond the program's wall time
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"out of memory")

# Call-based (APPS ``fn_name``) driver: args as JSON on stdin, the return value as JSON on
# stdout. The solution's own prints go to stderr so they cannot corrupt the result. The
# imports mirror what APPS/TACO graders provide to LeetCode-style solutions (``List[int]``).
_CALL_DRIVER = """\
import json, sys
out, sys.stdout = sys.stdout, sys.stderr
args = json.loads(sys.stdin.read())
namespace = {"__name__": "solution"}
exec("from typing import *\\nimport bisect, collections, functools, heapq, itertools, math, re, string",
     namespace)
with open(%(program)r) as f:
    exec(compile(f.read(), %(program)r, "exec"), namespace)
name = sys.argv[1]
fn = namespace.get(name)
if fn is None and isinstance(namespace.get("Solution"), type):
    fn = getattr(namespace["Solution"](), name, None)
if fn is None:
    sys.exit("no function or Solution method named %%r" %% name)
result = fn(*args) if isinstance(args, list) else fn(args)
out.write(json.dumps(result, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else repr(o)))
""" % {"program": PROGRAM_FILE}


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (a host problem, not the program's)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. CPU, memory and file size apply to each process of the run."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 5.0
    memory_mb: int = 256
    max_processes: int = 16
    max_file_mb: int = 8
    max_disk_mb: int = 32
    max_output_bytes: int = 65536

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0, got {getattr(self, field.name)!r}")


@dataclass(frozen=True)
class RunResult:
    """Outcome of one run.

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit), ``timeout`` (wall
    clock or CPU limit), ``memory`` (failed allocation), ``killed`` (a signal,
    or stopped for writing more than ``max_output_bytes``). ``exit_code`` is
    the exit status (negative: killed by that signal), ``None`` when the
    sandbox stopped the program. ``isolation`` names what was enforced (see
    the module docstring).
    """

    status: RunStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    output_truncated: bool = False
    isolation: tuple[str, ...] = ()


@dataclass(frozen=True)
class TestReport:
    """Per-test results of ``run_tests``; ``results[i]`` belongs to ``tests[i]``, and tests after the last
    result were skipped (``skipped``)."""

    __test__ = False  # not a pytest test class

    passed: int
    total: int
    results: tuple[RunResult, ...]

    @property
    def skipped(self) -> int:
        """Tests not run because an earlier one stopped the program's run (``run_tests``'s ``stop_after``)."""
        return self.total - len(self.results)

    @property
    def pass_rate(self) -> float:
        """Share of tests passed (0.0 for no tests): the code reward."""
        return self.passed / self.total if self.total else 0.0


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``source`` as ``solution.py`` with ``stdin`` as its standard input."""
    return _run({PROGRAM_FILE: source}, [PROGRAM_FILE], stdin, limits)


StopAfter = Literal["timeout", "failure", "never"]


def run_tests(source: str, tests: list[tuple[str, str]], limits: SandboxLimits = SandboxLimits(),
              fn_name: str | None = None, stop_after: StopAfter = "timeout") -> TestReport:
    """Run ``source`` once per test, APPS semantics; a test passes only if the run exits 0.

    ``stop_after``: the remaining tests are skipped (and count as failed)
    after the first test that times out (``"timeout"``: a program that loops
    forever then costs one time limit, not one per test, and its pass rate,
    0, is unchanged), after the first test that fails for any reason
    (``"failure"``: cheapest, but a program that fails one test and would
    pass later ones scores lower), or never.

    Standard-input mode (``fn_name`` None): a test is ``(stdin, expected stdout)``
    and passes when the output equals the expected one up to whitespace
    (``outputs_match``). Call-based mode: the program defines ``fn_name`` (a
    function, or a method of a class ``Solution``); a test is ``(JSON list of
    arguments, JSON of the expected return value)`` and passes when the return
    value equals it (``call_result_matches``).
    """
    results, passed, last_ok = [], 0, True
    for stdin, expected in tests:
        if results and stop_after != "never" and (
                results[-1].status == "timeout" or (stop_after == "failure" and not last_ok)):
            break
        if fn_name is None:
            result = run_program(source, stdin, limits)
            ok = outputs_match(result.stdout, expected)
        else:
            files = {PROGRAM_FILE: source, _CALL_FILE: _CALL_DRIVER}
            result = _run(files, [_CALL_FILE, fn_name], stdin, limits)
            ok = call_result_matches(result.stdout, expected)
        last_ok = ok and result.status == "ok" and not result.output_truncated
        passed += int(last_ok)
        results.append(result)
    return TestReport(passed=passed, total=len(tests), results=tuple(results))


def outputs_match(stdout: str, expected: str) -> bool:
    """Equal up to whitespace: the same sequence of whitespace-separated tokens."""
    return stdout.split() == expected.split()


def call_result_matches(stdout: str, expected_json: str) -> bool:
    """The JSON return value equals the expected one (floats to 1e-9; APPS' ``[value]`` wrapping allowed)."""
    try:
        got, want = json.loads(stdout), json.loads(expected_json)
    except ValueError:
        return False
    if _json_equal(got, want):
        return True
    return isinstance(want, list) and len(want) == 1 and _json_equal(got, want[0])


def _json_equal(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        numbers = (int, float)
        return (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _run(files: dict[str, str], argv: list[str], stdin: str, limits: SandboxLimits) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="reflow-sandbox-")
    try:
        for name, text in {**files, _STDIN_FILE: stdin}.items():
            Path(workdir, name).write_text(text, encoding="utf-8")
        uid = _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW) if os.geteuid() == 0 else os.geteuid()
        cfg = {"workdir": workdir, "files": list(files), "argv": argv, "uid": uid,
               "cpu_seconds": limits.cpu_seconds, "wall_seconds": limits.wall_seconds,
               "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
               "max_file_mb": limits.max_file_mb, "max_disk_mb": limits.max_disk_mb}
        return _launch(cfg, Path(workdir, _STDIN_FILE), limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _launch(cfg: dict, stdin_path: Path, limits: SandboxLimits) -> RunResult:
    """Start the launcher, collect its output and report, turn them into a ``RunResult``."""
    report_r, report_w = os.pipe()
    cfg["report_fd"] = report_w
    start = time.monotonic()
    try:
        with open(stdin_path, "rb") as stdin_file:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", LAUNCHER, json.dumps(cfg)],
                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=_LAUNCHER_ENV, cwd=cfg["workdir"], start_new_session=True, pass_fds=(report_w,))
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    with proc:
        stdout, stderr, report, truncated, hung = _collect(proc, report_r, limits)
    wall = time.monotonic() - start
    info = json.loads(report) if report else {}
    if "error" in info:
        raise SandboxError(info["error"])
    if not info.get("cleaned") and os.geteuid() == 0:
        kill_uid(cfg["uid"])  # backstop: the launcher died or could not kill everything
    if hung or not info:
        detail = "did not finish" if hung else f"exited {proc.returncode} without a report"
        return RunResult("killed", None, stdout.decode(errors="replace"),
                         f"sandbox launcher {detail}\n" + stderr.decode(errors="replace"), wall, truncated)
    status = _status(info, stderr, limits)
    exit_code = None if info["outcome"] in ("timeout", "stopped") else info["returncode"]
    return RunResult(status, exit_code, stdout.decode(errors="replace"), stderr.decode(errors="replace"),
                     info["wall_seconds"], truncated, tuple(info["isolation"]))


def _collect(proc: subprocess.Popen, report_fd: int,
             limits: SandboxLimits) -> tuple[bytes, bytes, bytes, bool, bool]:
    """Read stdout (head), stderr (tail) and the report until the launcher is gone.

    Returns (stdout, stderr, report, stdout truncated, launcher hung). When
    stdout overflows the launcher gets SIGTERM (it stops the program); when the
    launcher outlives the backstop it is killed.
    """
    cap = limits.max_output_bytes
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray(), report_fd: bytearray()}
    truncated = hung = False
    deadline = time.monotonic() + limits.wall_seconds + _BACKSTOP_SECONDS
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hung = True
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += chunk
                if key.fd == out_fd and len(buffer) > cap:
                    del buffer[cap:]
                    if not truncated:
                        truncated = True
                        proc.send_signal(signal.SIGTERM)
                elif key.fd == err_fd and len(buffer) > cap:
                    del buffer[:-cap]
    os.close(report_fd)
    if hung:
        proc.kill()
    proc.wait()
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), bytes(buffers[report_fd]), truncated, hung


def _status(info: dict, stderr: bytes, limits: SandboxLimits) -> RunStatus:
    if info["outcome"] == "timeout":
        return "timeout"
    if info["outcome"] == "stopped":
        return "killed"
    code = info["returncode"]
    if code == 0:
        return "ok"
    if code < 0:
        cpu_limit_hit = info["cpu_seconds"] >= math.ceil(limits.cpu_seconds)
        if -code == signal.SIGXCPU or (-code == signal.SIGKILL and cpu_limit_hit):
            return "timeout"
        return "killed"
    if any(marker in stderr[-2048:] for marker in _MEMORY_MARKERS):
        return "memory"
    return "error"
