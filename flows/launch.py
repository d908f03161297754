"""Flows a person launches from the Prefect UI (``reflow serve``): train, evaluate a run.

``train`` takes the config as its parameters, one per section in the order a
person fills them in (``mode`` first, then ``run``, ``rollout``, ``train`` ...),
each a typed sub-form of the section's fields. ``reflow serve`` serves it once
per experiment file (``configs/*.toml``), prefilled with that file's resolved
values, so the form opens on real defaults and ``train/default`` is what
``reflow run`` runs with no ``--config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_client, get_run_logger
from prefect.context import FlowRunContext
from pydantic import BaseModel

from reflow.config.load import load_config, validate_config
from reflow.config.schema import (
    BufferConfig,
    ConcurrencyConfig,
    EnvConfig,
    EvalConfig,
    ModeConfig,
    ModelConfig,
    PoolConfig,
    ReflowConfig,
    ResourcesConfig,
    RolloutConfig,
    RunConfig,
    StorageConfig,
    ToolsConfig,
    TrackingConfig,
    TrainConfig,
)
from reflow.flows.rl_train import rl_train
from reflow.infra.run import find_finished_run, load_config_of, new_run_id
from reflow.tasks.lifecycle import prepare_eval, teardown
from reflow.tasks.rollout import evaluate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# The train form's sections, in the order of ``train``'s parameters (every section of the config).
SECTIONS = ("mode", "run", "rollout", "train", "env", "model", "buffer", "eval", "concurrency", "tools",
            "resources", "pool", "tracking", "storage")
assert sorted(SECTIONS) == sorted(ReflowConfig.model_fields), "the train form must offer every config section"


def experiment_files() -> dict[str, Path]:
    """The experiment files a deployment is served for, by name (``configs/<name>.toml``)."""
    return {p.stem: p for p in sorted(CONFIGS.glob("*.toml"))}


def experiment_summary(path: Path) -> str:
    """The leading comment of an experiment file (what it is for), as one paragraph."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def form_values(path: Path | None, run_overrides: list[str]) -> dict[str, dict[str, Any]]:
    """The train form's parameters prefilled from an experiment file (None: the built-in defaults)."""
    cfg = load_config(path, run_overrides)
    return {name: getattr(cfg, name).model_dump(mode="json") for name in SECTIONS}


def form_config(sections: dict[str, BaseModel]) -> ReflowConfig:
    """The config a filled-in train form stands for; ConfigError naming the fields that do not fit together.

    A field left at its built-in default counts as not given, as in a TOML file that omits it, so the
    workload's own defaults apply: the default form with env.kind switched to math runs as
    ``reflow run --set env.kind=math`` does.
    """
    return validate_config({name: section.model_dump(exclude_defaults=True) for name, section in sections.items()},
                           "the train form")


@flow(name="train", log_prints=True)
def train_flow(mode: ModeConfig = ModeConfig(), run: RunConfig = RunConfig(),
               rollout: RolloutConfig = RolloutConfig(), train: TrainConfig = TrainConfig(),
               env: EnvConfig = EnvConfig(), model: ModelConfig = ModelConfig(), buffer: BufferConfig = BufferConfig(),
               eval: EvalConfig = EvalConfig(), concurrency: ConcurrencyConfig = ConcurrencyConfig(),
               tools: ToolsConfig = ToolsConfig(), resources: ResourcesConfig = ResourcesConfig(),
               pool: PoolConfig = PoolConfig(), tracking: TrackingConfig = TrackingConfig(),
               storage: StorageConfig = StorageConfig()) -> dict[str, Any]:
    """Train a policy with the config the form holds (each section's fields are checked together here).

    Args:
        mode: how generation and training overlap: sync, one_step_off, async or reflow.
        run: the run's name, seed, length, checkpoints and the folder its directory goes in.
        rollout: generation: engine, batch shape, sampling, SortedRL scheduling.
        train: the GRPO update: learning rate, clipping, loss, KL, advantages.
        env: the workload (arith, math, code, tool_calc or custom) and its data and reward.
        model: the policy: a model directory or Hub id, or the tiny built-in one.
        buffer: the staleness-bounded replay buffer (async and reflow).
        eval: held-out evaluation.
        concurrency: in-flight generation requests per engine (streaming modes).
        tools: multi-turn tool calls (tool_calc).
        resources: Ray: cluster address, CPUs and GPUs per actor, threads.
        pool: the elastic pool's stage-speed scheduler (resources.flex_workers).
        tracking: MLflow.
        storage: where the Delta tables live.
    """
    sections = {"mode": mode, "run": run, "rollout": rollout, "train": train, "env": env, "model": model,
                "buffer": buffer, "eval": eval, "concurrency": concurrency, "tools": tools, "resources": resources,
                "pool": pool, "tracking": tracking, "storage": storage}
    cfg = form_config(sections)
    run_id = new_run_id(cfg)
    run_dir = str((Path(cfg.run.out_dir) / run_id).resolve())
    get_run_logger().info("run %s: mode=%s steps=%d, run directory %s", run_id, cfg.mode.kind,
                          cfg.run.total_steps, run_dir)
    with get_client(sync_client=True) as client:  # the UI lists the launch under the run's id, as its subflow
        client.update_flow_run(flow_run_id=FlowRunContext.get().flow_run.id, name=f"train {run_id}")
    outcome = rl_train.with_options(log_prints=True)(config=cfg, run_dir=run_dir, run_id=run_id)
    return {"run_dir": outcome.run_dir, "mlflow_run_id": outcome.mlflow_run_id, "mlflow_ui": outcome.tracking_ui,
            "delta_tables": outcome.store_root, "final_model": outcome.final_model}


@flow(name="evaluate", flow_run_name="evaluate {run}", log_prints=True)
def evaluate_run(run: str, runs: str = "runs") -> dict[str, float]:
    """Held-out accuracy of a finished run's final model, on fresh workers (as ``reflow evaluate RUN``).

    Args:
        run: a run id under runs (the name of its directory, e.g. smoke-20261204-101500-123), or a run directory.
        runs: the folder of run directories.
    """
    run_dir = str(find_finished_run(run, runs))
    failed = True
    try:
        prepare_eval(run_dir)
        result = evaluate(run_dir, step=load_config_of(run_dir).run.total_steps)
        print(f"{run_dir}: held-out accuracy {result.eval_accuracy:.3f}")
        failed = False
        return {"accuracy": result.eval_accuracy, "reward_mean": result.eval_reward_mean,
                "response_length_mean": result.eval_response_length_mean}
    finally:
        teardown(run_dir, failed)
