"""Runs on a Ray cluster of several nodes (``ray.cluster_utils.Cluster``: each node its own raylet on this machine).

The head has no CPU and each of the two worker nodes one. Every mode runs with two engines (half a CPU each,
spread: one per node) and a trainer of two FSDP2 ranks (half a CPU each), so the actors must span both nodes;
``reflow run`` joins the cluster by ``resources.ray_address`` as it would a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from reflow.storage.metrics import mlflow_name

from .test_rl_train_e2e import REPO

MODES = [("sync", "plain"), ("one_step_off", "plain"), ("async", "plain"), ("reflow", "sorted_partial"),
         ("sync", "sorted_partial")]  # the last: SortedRL rounds over both engines, one rollout cache


@pytest.mark.slow
def test_every_mode_runs_with_two_engines_and_two_trainer_ranks_over_two_nodes(tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        workers = {cluster.add_node(num_cpus=1).node_id for _ in range(2)}
        cluster.wait_for_nodes()
        out = tmp_path / "runs"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
        seen: set[Path] = set()
        for mode, scheduling in MODES:
            proc = subprocess.run(
                [sys.executable, "-m", "reflow.cli.main", "run", "--config", str(REPO / "configs/smoke.toml"),
                 "--runs", str(out), "--set", f'model.cache_dir="{tmp_path / "models"}"',
                 "--set", 'rollout.engine="transformers"', "--set", "run.total_steps=2",
                 "--set", f'mode.kind="{mode}"', "--set", f'rollout.scheduling="{scheduling}"',
                 "--set", f'resources.ray_address="{cluster.address}"', "--set", "resources.torch_threads=1",
                 "--set", "resources.engines=2", "--set", "resources.engine_cpus=0.5",
                 "--set", "resources.trainer_ranks=2", "--set", "resources.trainer_cpus=0.5"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, (mode, proc.stdout[-3000:] + proc.stderr[-3000:])
            (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file() and p not in seen]
            seen.add(run_dir)
            record = json.loads((run_dir / "run.json").read_text())
            nodes = record["nodes"]
            print(mode, scheduling, {name: node[:8] for name, node in nodes.items()})
            assert set(nodes) == {"engine-0", "engine-1", "trainer", "trainer-rank-1"}, nodes
            assert nodes["engine-0"] != nodes["engine-1"], nodes  # spread
            assert set(nodes.values()) == workers  # both worker nodes, not the CPU-less head
            assert "workers on engine-0: node" in proc.stdout

            cfg = json.loads((run_dir / "config.json").read_text())
            per_step = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
            rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
            ids = rows["trajectory_id"].to_pylist()
            assert len(set(ids)) == len(ids) and len(ids) >= (2 * per_step if mode in ("sync", "one_step_off")
                                                              else per_step), (mode, len(ids))
            if scheduling == "sorted_partial" and mode == "sync":  # group g is engine g % 2's: both generated
                cache = DeltaTable(str(run_dir / "tables/rollout_cache")).to_pyarrow_dataset().to_table()
                positions = {int(t.split("/")[1][1:]) for t in ids} | set(cache["group_index"].to_pylist())
                assert {g % 2 for g in positions if g >= 0} == {0, 1}, positions
            usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table()
            assert sorted(set(usage["trainer_step"].to_pylist())) == [0, 1], mode  # contiguous
            assert set(usage["trajectory_id"].to_pylist()) <= set(ids), mode
            client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
            history = client.get_metric_history(record["mlflow_run_id"], mlflow_name("loss"))
            assert sorted(m.step for m in history) == sorted({m.step for m in history}) and len(history) == 2, mode
            assert (run_dir / "checkpoints/step-000001/sharded/.metadata").is_file(), mode
    finally:
        cluster.shutdown()
