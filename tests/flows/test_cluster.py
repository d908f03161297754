"""A run on a Ray cluster of several nodes (``ray.cluster_utils.Cluster``: each node its own raylet on this machine).

The head has no CPU and each worker node one, so the engine and the trainer (one CPU each) must land on
different nodes; ``reflow run`` joins the cluster by ``resources.ray_address`` as it would a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from .test_rl_train_e2e import REPO


@pytest.mark.slow
def test_a_run_joins_a_two_node_cluster_with_engine_and_trainer_on_different_nodes(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        out = tmp_path / "runs"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
        proc = subprocess.run(
            [sys.executable, "-m", "reflow.cli.main", "run", "--config", str(REPO / "configs/smoke.toml"),
             "--runs", str(out), "--set", f'model.cache_dir="{tmp_path / "models"}"',
             "--set", 'rollout.engine="transformers"', "--set", "run.total_steps=2",
             "--set", f'resources.ray_address="{cluster.address}"', "--set", "resources.torch_threads=1"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
        record = json.loads((run_dir / "run.json").read_text())
        worker_nodes = {node.node_id for node in workers}
        assert set(record["nodes"]) == {"engine-0", "trainer"}
        assert record["nodes"]["engine-0"] != record["nodes"]["trainer"], record["nodes"]
        assert set(record["nodes"].values()) == worker_nodes  # not on the CPU-less head
        assert "workers on engine-0: node" in proc.stdout
        rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
        cfg = json.loads((run_dir / "config.json").read_text())
        assert rows.num_rows == 2 * cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
        assert len(set(rows["trajectory_id"].to_pylist())) == rows.num_rows
        steps = [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert steps == [0, 1]
    finally:
        cluster.shutdown()
