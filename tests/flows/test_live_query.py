"""`reflow query` on a run that is still writing: the latest run is found, its tables read at a consistent version."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_query_a_run_while_it_writes(tmp_path: Path, reflow_process) -> None:
    out = tmp_path / "runs"
    run = reflow_process(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out),
                          "--set", "run.total_steps=4", "--set", 'rollout.engine="transformers"',
                          "--set", f'model.cache_dir="{tmp_path / "models"}"'], tmp_path)
    run.wait_for_step(1)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "reflow.cli.main", "query",
                           "SELECT count(*) AS samples, max(policy_version) AS newest FROM trajectories",
                           "--runs", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    print(f"query on the live run: {seconds:.2f} s", flush=True)
    assert done.returncode == 0, done.stderr
    samples = int(done.stdout.splitlines()[2].split()[0])
    assert samples > 0 and run.proc.poll() is None, (done.stdout, run.output())  # read while it still ran
    assert run.finish() == 0, run.output()
