"""A worker actor whose process dies mid-run is restarted by Ray, its calls re-issued, and the run completes."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from deltalake import DeltaTable

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 6


def _kill_worker(run, role: str, worker_pid) -> int:
    """SIGKILL the run's ``ray::<role>`` process; wait until Ray has started another; return the old pid."""
    pid = worker_pid(run.proc.pid, role)
    assert pid is not None, f"no {role} process:\n{run.output()}"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while worker_pid(run.proc.pid, role) in (None, pid):
        assert run.proc.poll() is None, f"the run ended after {role} died:\n{run.output()}"
        assert time.monotonic() < deadline, f"{role} was not restarted:\n{run.output()}"
        time.sleep(0.2)
    return pid


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_engine_and_trainer_are_restarted(tmp_path: Path, reflow_process, worker_pid, mode: str) -> None:
    out = tmp_path / "runs"
    run = reflow_process(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out),
                   "--set", f"run.total_steps={TOTAL_STEPS}", "--set", "run.checkpoint_every_steps=2",
                   "--set", f'mode.kind="{mode}"', "--set", 'rollout.engine="transformers"',
                   "--set", f'model.cache_dir="{tmp_path / "models"}"'], tmp_path)
    run.wait_for_step(2)
    _kill_worker(run, "EngineWorker", worker_pid)
    run.wait_for_step(4)
    # the newest checkpoint may be older than step 4: the new trainer replays the usage log after it
    _kill_worker(run, "TrainerWorker", worker_pid)
    assert run.finish() == 0, run.output()
    assert run.steps_seen()[-1] == TOTAL_STEPS, run.output()
    if mode == "async":  # the engine always has requests in flight in a streaming run
        # search all of it: a 4,000-character tail cut this line in half once ("... actor restarted: ...")
        assert "engine actor restarted: re-issued" in run.output(tail=None), run.output()

    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
    ids = rows["trajectory_id"].to_pylist()
    assert len(ids) == len(set(ids))
    usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table()
    cfg = json.loads((run_dir / "config.json").read_text())
    per_step = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
    assert Counter(usage["trainer_step"].to_pylist()) == {s: per_step for s in range(TOTAL_STEPS)}
    # the restarted trainer continued from the version it died at (checkpoint + replayed steps)
    assert dict(zip(usage["trainer_step"].to_pylist(), usage["trainer_version"].to_pylist())) == {
        s: s for s in range(TOTAL_STEPS)}
    assert set(usage["trajectory_id"].to_pylist()) <= set(ids)
    if mode == "sync":
        assert Counter(rows["rollout_step"].to_pylist()) == {s: per_step for s in range(TOTAL_STEPS)}
        # the restarted engine generated with the trainer's current weights, not the initial ones
        assert set(usage["staleness"].to_pylist()) == {0}
