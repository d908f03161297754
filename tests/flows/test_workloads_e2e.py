"""End to end per workload: a few steps of the math and code demos through the real CLI, vLLM, Ray, Delta, MLflow.

math runs sync (scoring in the ``score`` task); code runs async, so its programs are scored by the
streaming feeder's ``write_groups``, fanned out as Ray tasks.
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

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.intermediate_size=128",
         "model.tiny.sft_steps=10", "run.total_steps=3", "run.checkpoint_every_steps=3",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "env.eval_prompts=4", "eval.every_steps=2"]


def _run(workload: str, extra: list[str], tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "runs"
    sets = [*SMALL, f'model.cache_dir="{tmp_path / "models"}"', *extra]
    args = ["run", "--config", str(REPO / f"configs/{workload}.toml"), "--runs", str(out)]
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
        assert len(client.get_metric_history(run_id, mlflow_name(key))) == 3, key
    assert client.get_metric_history(run_id, mlflow_name("eval_accuracy")), "held-out evaluation was logged"
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


def _readme_reward() -> str:
    """The reward function the README shows (the code block that starts with ``# my_reward.py``)."""
    text = (REPO / "README.md").read_text()
    start = text.index("```python\n# my_reward.py\n") + len("```python\n")
    return text[start:text.index("```", start)]


@pytest.mark.slow
@pytest.mark.vllm
def test_custom_reward_from_the_readme_end_to_end(tmp_path: Path) -> None:
    """The README's reward function and config, on arith prompts, with a model given by its Hub id.

    `reflow model init` builds the model; the test lays it out in a Hugging Face cache of its own, as a
    download would have, and the run names it ``reflow-test/tiny-arith``.
    """
    from reflow.config.schema import EnvConfig
    from reflow.envs.arith import ArithEnv
    from tests.policies.test_hub import hub_cache_entry

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect"),
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    cli = [sys.executable, "-m", "reflow.cli.main"]
    small = [s for s in SMALL if s.startswith("model.tiny.")] + [f'model.cache_dir="{tmp_path / "models"}"']
    init = subprocess.run([*cli, "model", "init", *[a for s in small for a in ("--set", s)]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert init.returncode == 0, init.stderr[-3000:]
    hub_cache_entry(tmp_path / "hub", "reflow-test/tiny-arith", Path(init.stdout.strip().splitlines()[-1]))
    (tmp_path / "my_reward.py").write_text(_readme_reward())
    arith = ArithEnv(EnvConfig(), seed=7)
    rows = [{"prompt": p.text, "answer": p.answer} for p in arith.prompts("train", 0, 64)]
    (tmp_path / "my_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [s for s in SMALL if not s.startswith("model.tiny.")] + [
        'env.kind="custom"', 'env.data_path="my_rows.jsonl"', 'env.reward_function="my_reward.py:exact_answer"',
        'model.path="reflow-test/tiny-arith"', "env.eval_holdout_share=0.2"]
    out = tmp_path / "runs"
    run = subprocess.run([*cli, "run", "--runs", str(out), *[a for s in sets for a in ("--set", s)]], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    _check_tables_and_metrics(out, run_dir, "custom")
    rows_written = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
    assert set(rows_written["reward"].to_pylist()) <= {0.0, 1.0}
