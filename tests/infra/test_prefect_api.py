"""The ephemeral Prefect server of a command keeps its console quiet (its shutdown traceback stays out of it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reflow.infra.prefect_api import QUIET_SERVER_ENV

# What Prefect's server does at a shutdown that cancels a request: its logging set up as Prefect sets it up,
# then sqlalchemy's pool logs the rollback it could not finish.
SHUTDOWN_RACE = """
import asyncio, logging
import sqlalchemy
from prefect.logging.configuration import setup_logging
setup_logging()
try:
    raise asyncio.CancelledError()
except asyncio.CancelledError:
    logging.getLogger("sqlalchemy.pool.impl.AsyncAdaptedQueuePool").error("Exception during reset or similar",
                                                                          exc_info=True)
"""


def _stderr_of_the_race(tmp_path: Path, extra: dict[str, str]) -> str:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path), "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL", **extra}
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_RACE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_quiet_root_logger_alone_lets_the_shutdown_traceback_through(tmp_path: Path) -> None:
    """Why the server needs its own setting: sqlalchemy keeps its logger at WARNING whatever the root's level."""
    assert "Traceback" in _stderr_of_the_race(tmp_path, {})


def test_the_quiet_server_setting_keeps_the_shutdown_traceback_out(tmp_path: Path) -> None:
    assert "Traceback" not in _stderr_of_the_race(tmp_path, QUIET_SERVER_ENV)


@pytest.mark.slow
def test_a_command_starts_its_server_quiet_and_keeps_its_own_console(tmp_path: Path) -> None:
    """The setting reaches the server's environment only; the driver's Prefect console is unchanged."""
    probe = """
import os, sys
from reflow.cli.runtime import start_prefect_api
start_prefect_api()
from reflow.infra.prefect_api import prefect_server_pid
pid = prefect_server_pid()
server = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ").read().split("\\0") if "=" in e)
print(server.get("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"), os.environ.get("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "REFLOW_VERBOSE")}
    done = subprocess.run([sys.executable, "-c", probe], env={**env, "PREFECT_HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["CRITICAL", "None"], done.stdout + done.stderr


OVERLAP_PROBE = """
import os, httpx
from prefect.server.api.server import SubprocessASGIServer
from reflow.cli.runtime import prefect_api_starting
from reflow.infra.prefect_api import prefect_server_pid
ran = False
with prefect_api_starting():
    server = SubprocessASGIServer()
    launched = server.server_process is not None and server.server_process.poll() is None
    quiet_here = os.environ.get("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL")
    import reflow.flows.rl_train  # what a command does meanwhile
    ran = True
health = httpx.get(server.api_url + "/health").status_code
print(launched, quiet_here, ran, health, prefect_server_pid() == server.server_process.pid)
"""


def _probe(tmp_path: Path, script: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "REFLOW_VERBOSE")}
    return subprocess.run([sys.executable, "-c", script], env={**env, "PREFECT_HOME": str(tmp_path), **extra},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_a_command_imports_its_flow_while_the_server_starts_and_the_server_answers_after(tmp_path: Path) -> None:
    """The server process is launched before the block (with the quiet setting in its environment only), the block
    runs, and on leaving it the server answers and has its watchdog's pid recorded."""
    done = _probe(tmp_path, OVERLAP_PROBE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None", "True", "200", "True"], done.stdout + done.stderr


@pytest.mark.slow
def test_a_server_that_does_not_start_fails_the_command_after_the_block(tmp_path: Path) -> None:
    """Prefect's start-up limit passed: the block still ran, then its error is raised (not lost in the thread)."""
    script = OVERLAP_PROBE.replace("print(launched", "print('unreachable', launched")
    done = _probe(tmp_path, script, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timed out while attempting to connect to ephemeral Prefect API server" in done.stderr, done.stderr
    assert "unreachable" not in done.stdout
