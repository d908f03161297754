"""End to end per workload: a few steps of the math and code demos through the real CLI, vLLM, Ray, Delta, MLflow.

math runs sync (scoring in the ``score`` task); code runs async, so its programs are scored by the
streaming feeder's ``write_groups`` task, fanned out as Ray tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.intermediate_size=128",
         "model.tiny.sft_steps=10", "run.total_steps=3", "run.checkpoint_every_steps=3",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "env.eval_prompts=4", "eval.every_steps=2"]


def _run(workload: str, extra: list[str], tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "runs"
    sets = [*SMALL, f'model.cache_dir="{tmp_path / "models"}"', *extra]
    args = ["run", "--config", str(REPO / f"configs/{workload}.toml"), "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([sys.executable, "-m", "reflow.cli.main", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    return out, run_dir


def _check_tables_and_metrics(out: Path, run_dir: Path, workload: str) -> None:
    rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
    assert rows.num_rows >= 3 * 16 and set(rows["env"].to_pylist()) == {workload}
    rewards = rows["reward"].to_pylist()
    assert all(0.0 <= r <= 1.0 for r in rewards)
    for reward, correct in zip(rewards, rows["correct"].to_pylist()):
        assert correct == (reward == 1.0)
    usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table()
    assert usage.num_rows == 3 * 16

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in ("reward_mean", "accuracy", "loss"):
        assert len(client.get_metric_history(run_id, key)) == 3, key
    assert client.get_metric_history(run_id, "eval_accuracy"), "held-out evaluation was logged"
    assert client.get_run(run_id).data.params["env.kind"] == workload


@pytest.mark.slow
@pytest.mark.vllm
def test_math_workload_end_to_end(tmp_path: Path) -> None:
    out, run_dir = _run("math", [], tmp_path)
    _check_tables_and_metrics(out, run_dir, "math")


@pytest.mark.slow
@pytest.mark.vllm
def test_code_workload_async_end_to_end(tmp_path: Path) -> None:
    out, run_dir = _run("code", ['mode.kind="async"', "concurrency.initial_sequences=32",
                                 "concurrency.min_sequences=16"], tmp_path)
    _check_tables_and_metrics(out, run_dir, "code")
