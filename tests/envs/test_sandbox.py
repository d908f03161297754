"""Sandbox: hostile programs end with a failing status, the caller survives, nothing is left behind.

Tests of an isolation the OS does not grant here (see ``RunResult.isolation``)
are skipped with the missing mechanism named; on a root machine with
CAP_SYS_ADMIN (this project's machines) every test runs.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

import reflow
from reflow.envs.sandbox import RunResult, SandboxLimits, TestReport, outputs_match, run_program, run_tests

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=2)
ESCAPED = "ESCAPED"  # what a hostile program prints when its attack worked: the expected output
# Printed first by hostile programs so the test can look for their leftovers afterwards.
WHO = "import os\nprint(os.getuid(), os.getsid(0), flush=True)\n"


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    return run_program("pass").isolation


def require(isolation: tuple[str, ...], *names: str) -> None:
    missing = [name for name in names if name not in isolation]
    if missing:
        pytest.skip(f"the OS does not allow sandbox isolation {missing} here")


@pytest.fixture(autouse=True)
def sandbox_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Sandbox working directories go to a private folder that must be empty after each test."""
    folder = tmp_path / "sandbox-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    assert list(folder.iterdir()) == [], "a sandbox working directory was left behind"
    assert psutil.Process().children(recursive=True) == [], "a sandbox process was left behind"


def assert_nothing_left(result: RunResult, isolation: tuple[str, ...]) -> None:
    """No live process of the run's uid (when it had its own) or session remains."""
    uid, sid = (int(field) for field in result.stdout.split()[:2])
    leftovers = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if ("uid" in isolation and proc.info["uids"].real == uid) or os.getsid(proc.pid) == sid:
                leftovers.append(proc.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    assert leftovers == []


def assert_failed(report: TestReport) -> RunResult:
    result = report.results[0]
    assert report.passed == 0 and report.pass_rate == 0.0
    assert result.status != "ok", result
    return result


# --- hostile programs -------------------------------------------------------------------

def test_fork_bomb(isolation: tuple[str, ...]) -> None:
    require(isolation, "uid")  # RLIMIT_NPROC binds only under a uid of its own
    bomb = WHO + ("while True:\n    try:\n        os.fork()\n        os.setsid()\n"
                  "    except OSError:\n        pass\n")
    result = assert_failed(run_tests(bomb, [("", ESCAPED)], FAST))
    assert result.status == "timeout"
    assert_nothing_left(result, isolation)


def test_infinite_loop_hits_the_cpu_limit(isolation: tuple[str, ...]) -> None:
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=20)
    result = assert_failed(run_tests(WHO + "while True:\n    pass\n", [("", ESCAPED)], limits))
    assert result.status == "timeout" and result.exit_code == -signal.SIGXCPU
    assert_nothing_left(result, isolation)


def test_sleeping_program_hits_the_wall_clock(isolation: tuple[str, ...]) -> None:
    result = assert_failed(run_tests(WHO + "import time\ntime.sleep(60)\n", [("", ESCAPED)], FAST))
    assert result.status == "timeout" and result.exit_code is None
    assert_nothing_left(result, isolation)


def test_ten_gigabyte_allocation() -> None:
    result = assert_failed(run_tests(f"x = bytearray(10 * 2**30)\nprint({ESCAPED!r})", [("", ESCAPED)]))
    assert result.status == "memory" and "MemoryError" in result.stderr


@pytest.mark.parametrize("target", ["tmp", "dev_shm", "repo", "nested_namespace"])
def test_writing_outside_the_working_directory(target: str, isolation: tuple[str, ...]) -> None:
    require(isolation, "filesystem")
    name = f"sandbox_escape_{secrets.token_hex(6)}"
    path = {"tmp": Path("/tmp") / name, "dev_shm": Path("/dev/shm") / name,
            "repo": Path(reflow.__file__).parent / name, "nested_namespace": Path("/tmp") / name}[target]
    # A user namespace of its own (where the kernel allows it) gives capabilities over
    # a copy of the mounts; the read-only ones stay locked.
    unshare = ("import ctypes\nctypes.CDLL(None).unshare(0x10000000 | 0x20000)\n"
               if target == "nested_namespace" else "")
    program = f"{unshare}open({str(path)!r}, 'w').write('x')\nprint({ESCAPED!r})\n"
    try:
        result = assert_failed(run_tests(program, [("", ESCAPED)]))
        # Refused (read-only or not ours), or not even visible: a checkout under /tmp is hidden by the
        # sandbox's private /tmp, so the parent directory does not exist inside it.
        assert result.status == "error" and any(
            reason in result.stderr for reason in ("Read-only", "Permission", "No such file or directory"))
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_writing_inside_the_working_directory_works_up_to_the_file_limit() -> None:
    program = ("open('a.txt', 'w').write('x' * 1000)\nprint(len(open('a.txt').read()))\n"
               "open('b.txt', 'w').write('x' * (9 * 2**20))\n")
    result = run_program(program)
    assert result.stdout == "1000\n" and result.status == "error" and "File too large" in result.stderr


def test_network_connection_to_the_host_fails(isolation: tuple[str, ...]) -> None:
    require(isolation, "network")
    with socket.socket() as server:  # a listener on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                   f"s.sendall(b'x')\nprint({ESCAPED!r})\n")
        result = assert_failed(run_tests(program, [("", ESCAPED)]))
        assert result.status == "error" and "unreachable" in result.stderr
        server.setblocking(False)  # a connection that arrived would wait in the backlog
        with pytest.raises(BlockingIOError):
            server.accept()


def test_parent_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = secrets.token_hex(16)
    monkeypatch.setenv("REFLOW_TEST_SECRET", secret)
    result = assert_failed(run_tests("import os\nprint(os.environ['REFLOW_TEST_SECRET'])", [("", secret)]))
    assert result.status == "error" and "KeyError" in result.stderr
    dump = run_program("import os\nprint(dict(os.environ))")
    assert secret not in dump.stdout and "REFLOW_TEST_SECRET" not in dump.stdout


def test_parent_environment_is_not_readable_through_proc(monkeypatch: pytest.MonkeyPatch,
                                                         isolation: tuple[str, ...]) -> None:
    require(isolation, "uid")
    secret = secrets.token_hex(16)
    monkeypatch.setenv("REFLOW_TEST_SECRET", secret)
    program = f"print(open('/proc/{os.getpid()}/environ').read())"
    result = assert_failed(run_tests(program, [("", secret)]))
    assert secret not in result.stdout and result.status == "error"


@pytest.mark.parametrize("attack", [
    "os.kill({pid}, signal.SIGKILL)",
    "os.killpg(os.getpgid({pid}), signal.SIGKILL)",
    "os.kill(os.getppid(), signal.SIGKILL)",
    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    # kill(-1) reaches every process the caller may signal, except itself: with a uid of its
    # own that is no other process, so it returns; the program then fails on its parent.
    "os.kill(-1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)",
])
def test_killing_the_parent_fails(attack: str, isolation: tuple[str, ...]) -> None:
    require(isolation, "uid")  # under the caller's uid a program could kill the caller
    program = f"import os, signal\n{attack.format(pid=os.getpid())}\nprint({ESCAPED!r})\n"
    result = assert_failed(run_tests(program, [("", ESCAPED)]))
    assert result.status in ("error", "killed")  # refused, or it only reached itself
    assert run_program("print(1)").status == "ok"  # the caller (this test) still works


# --- functional behaviour ---------------------------------------------------------------

SUM_TESTS = [("1 2\n", "3\n"), ("10 20\n", "30"), ("100 200\n", "300\n")]


def test_correct_program_passes_all_tests() -> None:
    report = run_tests("a, b = map(int, input().split())\nprint(a + b)\n", SUM_TESTS)
    assert (report.passed, report.total, report.pass_rate) == (3, 3, 1.0)
    assert all(result.status == "ok" for result in report.results)


def test_wrong_program_gets_partial_credit() -> None:
    program = "a, b = map(int, input().split())\nprint(a + b if a < 50 else a - b)\n"
    report = run_tests(program, SUM_TESTS)
    assert (report.passed, report.total) == (2, 3)
    assert report.pass_rate == pytest.approx(2 / 3)


def test_crashing_program_fails_even_with_the_right_output() -> None:
    report = run_tests("print(3)\nraise SystemExit(1)\n", [("", "3")])
    assert report.passed == 0 and report.results[0].exit_code == 1


@pytest.mark.parametrize("program", [
    "def add(a, b):\n    print('debug output is ignored')\n    return a + b\n",
    "class Solution:\n    def add(self, a: int, b: int) -> int:\n        return a + b\n",
    "def add(a, b):\n    return float(a + b)\n",  # 3.0 == 3; expected "[30]" is APPS' wrapping
])
def test_call_based_tests(program: str) -> None:
    tests = [("[1, 2]", "3"), ("[10, 20]", "[30]"), ("[0, 0]", "1")]
    report = run_tests(program, tests, fn_name="add")
    assert (report.passed, report.total) == (2, 3)


def test_call_based_missing_function_fails() -> None:
    report = run_tests("def other(a):\n    return a\n", [("[1]", "1")], fn_name="add")
    assert report.passed == 0 and report.results[0].status == "error"


def test_stdout_is_truncated_at_the_limit() -> None:
    limits = SandboxLimits(max_output_bytes=1000)
    result = run_program("while True:\n    print('x' * 100)\n", limits=limits)
    assert len(result.stdout) == 1000 and result.output_truncated and result.status == "killed"
    small = run_program("print('x' * 999, end='')", limits=limits)
    assert len(small.stdout) == 999 and not small.output_truncated and small.status == "ok"


def test_outputs_match_ignores_whitespace_only() -> None:
    assert outputs_match("1 2\n3\n\n", "1 2 3")
    assert outputs_match("  7\r\n", "7")
    assert not outputs_match("12", "1 2")


def test_concurrent_runs_from_threads() -> None:
    """Prefect tasks call the sandbox from worker threads."""
    program = "n = int(input())\nprint(n * n)\n"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: run_program(program, f"{n}\n"), range(8)))
    assert [r.stdout.strip() for r in results] == [str(n * n) for n in range(8)]


def test_run_tests_and_reports_pickle() -> None:
    """``ray.remote(run_tests)`` ships the function and its results by pickle."""
    assert pickle.loads(pickle.dumps(run_tests)) is run_tests
    report = run_tests("print(input())", [("hi", "hi")])
    assert pickle.loads(pickle.dumps(report)) == report


def test_isolation_on_this_machine(isolation: tuple[str, ...]) -> None:
    """Names what was enforced; on a root machine with namespaces it is everything."""
    assert {"rlimits", "session", "environment"} <= set(isolation)
    if os.geteuid() == 0:
        require(isolation, "network")
        assert set(isolation) == {"rlimits", "session", "environment", "network", "filesystem", "proc", "uid"}


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="cpu_seconds"):
        SandboxLimits(cpu_seconds=0)


def test_a_program_that_times_out_skips_its_remaining_tests() -> None:
    loop = "while True:\n    pass\n"
    tests = [("", "1")] * 3
    report = run_tests(loop, tests, FAST)  # default: stop after a timeout
    assert [r.status for r in report.results] == ["timeout"] and report.skipped == 2
    assert (report.passed, report.total, report.pass_rate) == (0, 3, 0.0)  # the reward it always had
    full = run_tests(loop, tests, FAST, stop_after="never")
    assert [r.status for r in full.results] == ["timeout"] * 3 and full.skipped == 0 and full.pass_rate == 0.0


def test_failures_skip_the_rest_only_when_asked() -> None:
    echo = "print(input())\n"
    tests = [("1", "1"), ("2", "0"), ("3", "3")]  # the middle test expects another output
    kept = run_tests(echo, tests, FAST)  # a wrong answer is no timeout: every test runs
    assert (kept.passed, kept.skipped) == (2, 0)
    stopped = run_tests(echo, tests, FAST, stop_after="failure")
    assert (stopped.passed, stopped.skipped, len(stopped.results)) == (1, 1, 2)
    assert run_tests(echo, [("1", "1"), ("2", "2")], FAST, stop_after="failure").passed == 2
