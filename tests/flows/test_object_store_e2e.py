"""A run as it is set up on a cluster: Delta tables on an S3-compatible server, MLflow on a tracking server.

Both servers are real and run on this machine: moto's S3 server (``s3_server`` in tests/conftest.py) and
``mlflow server``; the run itself is the usual ``reflow run`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import polars as pl
import pytest

from reflow.storage.metrics import mlflow_name

from ..conftest import free_port, wait_until_answering
from .test_rl_train_e2e import REPO


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` on a free port (sqlite backend, artifacts proxied into tmp_path); yields its URI."""
    port = free_port()
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'tracking.db'}",
                               "--artifacts-destination", str(tmp_path / "artifacts")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    wait_until_answering(server, f"{uri}/health", 120, f"mlflow server (log: {log.name})")
    yield uri
    os.killpg(server.pid, 15)
    server.wait(timeout=30)
    log.close()


@pytest.mark.slow
def test_run_with_tables_on_s3_and_a_tracking_server(tmp_path: Path, s3_server: dict[str, str],
                                                      mlflow_server: str) -> None:
    root = f"s3://reflow/{uuid.uuid4().hex[:12]}"
    env = {**os.environ, **s3_server, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    out = tmp_path / "runs"

    def reflow(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "reflow.cli.main", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    reflow("run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out),
           "--set", f'model.cache_dir="{tmp_path / "models"}"', "--set", 'rollout.engine="transformers"',
           "--set", "run.total_steps=2", "--set", f'storage.root="{root}"',
           "--set", f'tracking.tracking_uri="{mlflow_server}"')
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    record, cfg = json.loads((run_dir / "run.json").read_text()), json.loads((run_dir / "config.json").read_text())
    assert record["store_root"] == root and not (run_dir / "tables").exists()  # nothing written locally
    batch = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]

    # the tables on the object store, read by another reader (polars, with the same environment)
    os.environ.update(s3_server)
    try:
        rows = pl.read_delta(f"{root}/trajectories")
        usage = pl.read_delta(f"{root}/usage")
    finally:
        for key in s3_server:
            os.environ.pop(key)
    assert rows.height == 2 * batch and rows["trajectory_id"].n_unique() == rows.height
    assert sorted(usage["trainer_step"].unique().to_list()) == [0, 1]
    # and by reflow query, which finds the store through the run's record
    shown = reflow("query", "SELECT count(*) AS n FROM trajectories", run_dir.name, "--runs", str(out)).stdout
    assert f"\n{2 * batch}" in shown.replace(" ", "\n"), shown

    # MLflow on the tracking server: the run finished, one value per step
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, mlflow_name("reward_mean"))] == [0, 1]
    assert "config" in {a.path for a in client.list_artifacts(run.info.run_id)}  # proxied to the server
