"""A worker node lost mid-run (``ray.cluster_utils.Cluster``: each node its own raylet on this machine).

The run has two engines (one per worker node) and one trainer. The node holding the trainer is removed
after the first step is recorded, and a replacement node joins, as a cluster's autoscaler would add one.
Ray restarts the dead actors there (the engine's placement-group bundle moves with it), the restarted
trainer loads the newest checkpoint and replays the usage log after it, and the run finishes with no
trajectory lost or trained twice.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from deltalake import DeltaTable

from reflow.storage.metrics import mlflow_name

from .test_rl_train_e2e import REPO

STEPS = 4


@pytest.mark.slow
def test_losing_the_trainers_node_mid_run_loses_and_doubles_nothing(tmp_path: Path, reflow_process) -> None:
    from mlflow import MlflowClient
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {node.node_id: node for node in (cluster.add_node(num_cpus=1) for _ in range(2))}
        cluster.wait_for_nodes()
        out = tmp_path / "runs"
        attempt = reflow_process(
            ["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out),
             "--set", f'model.cache_dir="{tmp_path / "models"}"', "--set", 'rollout.engine="transformers"',
             "--set", f"run.total_steps={STEPS}", "--set", "run.checkpoint_every_steps=1",
             "--set", f'resources.ray_address="{cluster.address}"', "--set", "resources.torch_threads=1",
             "--set", "resources.engines=2", "--set", "resources.engine_cpus=0.5",
             "--set", "resources.trainer_cpus=0.5"], cwd=tmp_path)
        attempt.wait_for_step(1, timeout=400)
        (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
        placed = json.loads((run_dir / "run.json").read_text())["nodes"]
        lost = placed["trainer"]
        assert lost in nodes and sum(node == lost for node in placed.values()) == 2, placed  # trainer + an engine
        cluster.remove_node(nodes[lost])
        replacement = cluster.add_node(num_cpus=1)
        seen = attempt.steps_seen()
        code = attempt.finish(timeout=600)
        assert code == 0, attempt.output()
        restarts = _restarts(cluster.address)
        print(f"lost node {lost[:8]} after step(s) {seen} were printed; replacement {replacement.node_id[:8]}; "
              f"actor restarts {restarts}")
        assert restarts["TrainerWorker"] >= 1 and restarts["EngineWorker"] >= 1, restarts

        cfg = json.loads((run_dir / "config.json").read_text())
        per_step = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
        rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
        ids = rows["trajectory_id"].to_pylist()
        per_round = Counter(rows["rollout_step"].to_pylist())
        usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table()
        used = Counter(usage["trajectory_id"].to_pylist())
        print(f"trajectories {len(ids)} ({len(set(ids))} distinct), per round {dict(sorted(per_round.items()))}; "
              f"usage rows {usage.num_rows}, steps {sorted(set(usage['trainer_step'].to_pylist()))}")
        assert len(set(ids)) == len(ids) == STEPS * per_step  # none lost, none written twice
        assert per_round == {step: per_step for step in range(STEPS)}
        assert sorted(set(usage["trainer_step"].to_pylist())) == list(range(STEPS))
        assert set(used) == set(ids) and set(used.values()) == {1}  # sync: each trained on exactly once
        client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
        run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
        history = client.get_metric_history(run_id, mlflow_name("loss"))
        assert len(history) == STEPS and len({m.step for m in history}) == STEPS
    finally:
        cluster.shutdown()


def _restarts(address: str) -> Counter:
    """Restarts by Ray of the run's actors, by class, from the cluster's actor table (the GCS keeps dead actors;
    the state API would need the dashboard, which this cluster does not run)."""
    import ray
    from ray._private import state

    ray.init(address=address, log_to_driver=False, logging_level="warning")
    try:
        counts: Counter = Counter()
        for a in state.actors().values():
            counts[a["ActorClassName"]] += int(a["NumRestarts"])
        return counts
    finally:
        ray.shutdown()
