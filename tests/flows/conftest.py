"""Helpers of the end-to-end tests that run ``reflow`` as a process and kill it or its workers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest


def _session_pids(sid: int) -> list[int]:
    """Pids of the processes in session ``sid``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                found.append(int(pid))
        except OSError:
            continue
    return found


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _session_processes(sid: int, others: tuple[int, ...] = ()) -> list[str]:
    """Command lines of live processes in session ``sid`` (the killed driver's: Ray, actors) and of ``others``."""
    found = []
    for pid in [*_session_pids(sid), *others]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie is already dead
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except (OSError, IndexError):
            continue
    return found


# A Ray worker that was still starting when its raylet and GCS were killed (its command line is still
# default_worker.py) exits only when its GCS client gives up reconnecting (gcs_rpc_server_reconnect_timeout_s,
# 60 s by default); live workers notice the raylet's death within a second. Seen on CI at 20 s.
SURVIVOR_WAIT_S = 90


class Attempt:
    """One ``reflow run``/``reflow resume`` process in its own session, its output read line by line."""

    def __init__(self, args: list[str], cwd: Path, ray_tmp: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(cwd / "prefect"), "RAY_TMPDIR": ray_tmp}
        self.proc = subprocess.Popen([sys.executable, "-m", "reflow.cli.main", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.helpers: tuple[int, ...] = ()  # the driver's children in sessions of their own (Prefect's server)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def steps_seen(self) -> list[int]:
        with self.cond:
            return [int(line.split()[1].split("/")[0]) for line in self.lines if line.startswith("step ")]

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        """Until the progress line of 1-based ``step`` is printed (``step`` 0: any step)."""
        deadline = time.monotonic() + timeout
        with self.cond:  # an RLock: steps_seen takes it again
            while not (seen := self.steps_seen()) or (step and step not in seen):
                assert self.proc.poll() is None, f"exited before step {step}:\n{self.output()}"
                assert time.monotonic() < deadline, f"no step {step} in time:\n{self.output()}"
                self.cond.wait(1.0)

    def wait_for_line(self, prefix: str, timeout: float = 240) -> None:
        """Until a line starting with ``prefix`` is printed."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not any(line.startswith(prefix) for line in self.lines):
                assert self.proc.poll() is None, f"exited before {prefix!r}:\n{self.output()}"
                assert time.monotonic() < deadline, f"no {prefix!r} in time:\n{self.output()}"
                self.cond.wait(1.0)

    def send(self, signum: int, group: bool = False) -> None:
        """Send ``signum`` to the driver (as `kill PID` does) or to its process group (a terminal's Ctrl-C);
        first note the driver's children that run in sessions of their own, for ``survivors``."""
        assert self.proc.poll() is None, "the attempt finished before the signal:\n" + self.output()
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.helpers = tuple(c.pid for c in children if _sid(c.pid) not in (None, self.proc.pid))
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the driver's whole process group, then check nothing of it survives."""
        self.send(signal.SIGKILL, group=True)
        self.proc.wait(timeout=30)
        left = self.survivors()
        assert not left, f"processes of the killed run are still alive: {left}"

    def survivors(self, timeout: float = SURVIVOR_WAIT_S) -> list[str]:
        """Processes of the attempt's session, and the helpers ``send`` noted, still alive after waiting up to
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := _session_processes(self.proc.pid, self.helpers)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def finish(self, timeout: float = 300) -> int:
        """The run's exit code; a run still going after ``timeout`` seconds fails the test with the last of what
        it printed (where a hung run and a slow one differ)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not finish within {timeout:.0f} s; it printed:\n{self.output()}")

    def output(self, tail: int | None = 4000) -> str:
        """What the run printed: the last ``tail`` characters (for failure messages), or all of it (None)."""
        text = "".join(self.lines)
        return text if tail is None else text[-tail:]



def worker_pid(sid: int, role: str) -> int | None:
    """Pid of the live ``ray::<role>`` process (EngineWorker, TrainerWorker) in session ``sid``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(
                    f"ray::{role}".encode()):
                return int(pid)
        except OSError:
            continue
    return None


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """A short temp dir for Ray (its socket paths must fit in 107 bytes), removed afterwards."""
    path = tempfile.mkdtemp(prefix="rf-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def reflow_process(ray_tmp: str) -> Iterator:
    """Start ``python -m reflow.cli.main ARGS`` in ``cwd`` as an ``Attempt`` (Ray under ``ray_tmp``).

    Afterwards (also when the test failed half-way) whatever is left of each attempt's session is killed.
    """
    attempts: list[Attempt] = []

    def start(args: list[str], cwd: Path) -> Attempt:
        attempts.append(Attempt(args, cwd, ray_tmp))
        return attempts[-1]

    yield start
    for attempt in attempts:
        for pid in _session_pids(attempt.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if attempt.proc.poll() is None:
            attempt.proc.wait(timeout=30)


@pytest.fixture(name="worker_pid")
def worker_pid_fixture():
    """``worker_pid(sid, role)``."""
    return worker_pid
