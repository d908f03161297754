"""SIGTERM (``kill``, a job scheduler) and Ctrl-C stop a run cleanly: exit 130, no traceback, nothing left running."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_driver_stops_the_run_cleanly(tmp_path: Path, reflow_process, signum: int) -> None:
    run = reflow_process(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(tmp_path / "runs"),
                          "--set", "run.total_steps=50", "--set", 'rollout.engine="transformers"',
                          "--set", f'model.cache_dir="{tmp_path / "models"}"'], tmp_path)
    run.wait_for_step(1)
    run.send(signum)  # the driver only, as `kill PID` does; Ray and Prefect must go with it
    code = run.finish(timeout=90)
    assert code == 130, run.output()
    assert "interrupted" in run.output(tail=None)
    assert "Traceback" not in run.output(tail=None), run.output()
    assert max(run.steps_seen()) < 50
    left = run.survivors()
    assert not left, f"processes of the stopped run are still alive: {left}"


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_during_start_up_stops_the_run_in_seconds(tmp_path: Path, reflow_process) -> None:
    """A terminal's Ctrl-C reaches the whole process group. When Prefect's API server was in it, it stopped at
    once, and Prefect retried it while the run wound down: 75-123 s to exit, interrupted while starting Ray."""
    run = reflow_process(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(tmp_path / "runs"),
                          "--set", 'rollout.engine="transformers"',
                          "--set", f'model.cache_dir="{tmp_path / "models"}"'], tmp_path)
    run.wait_for_line("starting Ray and workers")
    time.sleep(1.0)
    assert not run.steps_seen(), run.output()
    run.send(signal.SIGINT, group=True)
    assert run.finish(timeout=45) == 130, run.output()
    assert run.output(tail=None).rstrip().endswith("interrupted"), run.output()
    assert len(run.helpers) == 2, run.helpers  # Prefect's API server and its watchdog
    left = run.survivors()
    assert not left, f"processes of the stopped run are still alive: {left}"


@pytest.mark.slow
def test_sigkill_of_the_driver_alone_leaves_nothing_running(tmp_path: Path, reflow_process) -> None:
    """No exit handler runs: Ray's processes and the ephemeral Prefect server must still go (a watchdog stops it)."""
    run = reflow_process(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(tmp_path / "runs"),
                          "--set", "run.total_steps=50", "--set", 'rollout.engine="transformers"',
                          "--set", f'model.cache_dir="{tmp_path / "models"}"'], tmp_path)
    run.wait_for_step(1)
    run.send(signal.SIGKILL)
    assert run.finish(timeout=30) == -signal.SIGKILL
    left = run.survivors()
    assert not left, f"processes of the killed run are still alive: {left}"
