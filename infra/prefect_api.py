"""The ephemeral Prefect API server of one command, stopped when the command dies however it dies.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server
(``uvicorn``, a child process) on first use and stops it at exit. A driver
killed by SIGKILL or the OOM killer never reaches its exit handlers, so the
server kept running, one more per crash. ``start_ephemeral_server`` starts it
up front (Prefect's own singleton, which the flows then reuse) together with
a watchdog process that stops it as soon as the driver is gone, and with it
the Ray processes the driver started and left behind (Ray's dashboard and
runtime-env agents otherwise wait forever on the dead GCS).

Both run in sessions of their own. A terminal's Ctrl-C goes to its whole
foreground process group: a server in it stopped at once, and Prefect, while
the command wound down, retried the dead server for a minute (a run
interrupted during its start-up took 75-123 s to exit). The watchdog ignores
SIGINT, and a SIGKILL of the driver's process group does not reach it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

# Runs as `python -c WATCHDOG DRIVER_PID SERVER_PID`, a child of the driver (so its parent changes when the driver
# ends, however it ends). While the driver runs it notes the Ray processes among the driver's descendants; once the
# driver is gone it stops the server if it is still up, and those Ray processes that outlived it: with their GCS
# gone, Ray's dashboard and runtime-env agents wait forever (a driver killed outright; or a `ray.init` interrupted
# half-way, which `ray.shutdown` does not undo). SIGTERM, SIGKILL after 5 s. Only the driver's own descendants:
# another Ray in its process group (a test runner's, started beside a `reflow` it runs) is left alone.
WATCHDOG = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
driver, server = int(sys.argv[1]), int(sys.argv[2])
def stat(pid):  # (parent pid, start time in clock ticks after boot) from /proc/PID/stat
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19])
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
def ray_descendants():  # pid -> start time of the driver's descendants that are Ray's
    parent, born = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parent[int(name)], born[int(name)] = stat(name)
            except (OSError, ValueError, IndexError):
                continue
    children = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [driver]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if cmd.startswith(b"ray::") or b"/site-packages/ray/" in cmd:
                found[pid] = born[pid]
    return found
seen = {}
while os.getppid() == driver:
    seen.update(ray_descendants())
    time.sleep(1.0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(2.0)  # Ray's GCS and raylet exit by themselves; what is left after that is stuck
def same(pid, born):
    try:
        return stat(pid)[1] == born
    except (OSError, ValueError, IndexError):
        return False
targets = [p for p in [server] if alive(p)] + [p for p, born in seen.items() if same(p, born)]
for pid in targets:
    os.kill(pid, signal.SIGTERM)
deadline = time.monotonic() + 5.0
while any(alive(p) for p in targets) and time.monotonic() < deadline:
    time.sleep(0.1)
for pid in targets:
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
"""


_SERVER_PID: int | None = None  # the server start_ephemeral_server started in this process


def prefect_server_pid() -> int | None:
    """The pid of the Prefect API server this process started (None: none, or one it did not start)."""
    return _SERVER_PID


# The server's own console handler (Prefect's logging.yml, ``handlers.console.level``). A server stopped at exit
# while a request is in flight logs sqlalchemy's "Exception during reset or similar" with a CancelledError
# traceback: sqlalchemy sets its "sqlalchemy" logger to WARNING when imported, so a quiet root logger does not
# hide it; only the handler's level does.
QUIET_SERVER_ENV = {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL"}


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` for the child processes started inside, as it was afterwards."""
    before = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _SessionSubprocess:
    """``subprocess`` as a module sees it, whose ``Popen`` starts the child in a session of its own."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args, **kwargs) -> subprocess.Popen:  # noqa: N802 (subprocess's name)
        return subprocess.Popen(*args, start_new_session=True, **kwargs)


@contextmanager
def _own_session(module) -> Iterator[None]:
    """While the block runs, the children ``module`` starts with ``subprocess.Popen`` get sessions of their own
    (Prefect's server launch takes no such option)."""
    module.subprocess = _SessionSubprocess()
    try:
        yield
    finally:
        module.subprocess = subprocess


def start_ephemeral_server(quiet: bool = False) -> int | None:
    """Start Prefect's ephemeral API server and its watchdog; the server's pid (None with ``PREFECT_API_URL``).

    ``quiet``: the server prints only critical records (this process's console is left as it is).
    """
    with ephemeral_server_starting(quiet):
        pass
    return _SERVER_PID


@contextmanager
def ephemeral_server_starting(quiet: bool = False) -> Iterator[None]:
    """Start Prefect's ephemeral API server (as ``start_ephemeral_server``) while the block runs, and wait for it to
    answer when the block ends. The server's start-up (about 9 s of one core: its imports and database) overlaps
    what the block does, such as importing the flow's modules (another 8 s, on the other core).

    Nothing in the block may call Prefect's API. A server that fails to start raises here, after the block.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        yield
        return
    from prefect.server.api import server as server_module
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's clients use in ephemeral mode
    if server.running:
        yield
        return
    launched, failed = threading.Event(), []
    command = server._run_uvicorn_command

    def quiet_command():  # the server's environment only: the caller waits for the first launch (a relaunch on a
        # port taken meanwhile sets it for the moment of the Popen)
        try:
            with _environment(QUIET_SERVER_ENV if quiet else {}), _own_session(server_module):
                return command()
        finally:
            launched.set()

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:  # raised in the caller's thread after the block
            failed.append(exc)
        finally:
            launched.set()

    server._run_uvicorn_command = quiet_command  # this instance only (Prefect's method, wrapped)
    waiter = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    waiter.start()
    launched.wait()  # the server process exists: what the block does overlaps its start-up
    try:
        yield
    finally:
        waiter.join()
        del server._run_uvicorn_command
    if failed:
        raise failed[0]
    if server.server_process is None:
        return
    global _SERVER_PID
    _SERVER_PID = server.server_process.pid
    watch(_SERVER_PID)


def watch(server_pid: int) -> None:
    """Start the watchdog (``WATCHDOG``) that stops the server ``server_pid`` if this process dies without doing so."""
    subprocess.Popen([sys.executable, "-I", "-c", WATCHDOG, str(os.getpid()), str(server_pid)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
