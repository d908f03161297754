"""Flows a person launches from the Prefect UI (``reflow serve``): train, evaluate a run.

Their parameters are what the UI turns into a form: the TOML experiment
(one of ``configs/*.toml``) and ``settings``, a tree generated from the config
model in which every field is optional; an empty field keeps the experiment
file's value (or the built-in default, given in the field's description).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

from prefect import flow, get_client, get_run_logger
from prefect.context import FlowRunContext
from pydantic import BaseModel, ConfigDict, Field, create_model

from reflow.config.load import config_to_json, load_config
from reflow.config.schema import ReflowConfig
from reflow.flows.rl_train import rl_train
from reflow.infra.run import load_config_of, new_run_id
from reflow.tasks.lifecycle import prepare_eval, teardown
from reflow.tasks.rollout import evaluate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# The experiment files a form offers (a drop-down in the UI).
ExperimentFile = enum.Enum("ExperimentFile", {p.stem: p.stem for p in sorted(CONFIGS.glob("*.toml"))}, type=str)


def _optional_tree(model: type[BaseModel], name: str) -> type[BaseModel]:
    """``model`` with every leaf optional (default None), descriptions and bounds kept."""
    fields: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sub = _optional_tree(ann, f"{name}{key.title()}")
            fields[key] = (sub, Field(default_factory=sub, description=info.description))
        else:
            default = info.get_default(call_default_factory=True)
            if get_origin(ann) is Literal:  # a plain enum with null: the UI's anyOf editor drops enum options
                optional: Any = Literal[(*get_args(ann), None)]
            else:
                optional = Optional[Annotated[ann, *info.metadata] if info.metadata else ann]
            fields[key] = (optional, Field(None, description=f"{info.description} "
                                                  f"(empty: the experiment file's value; built-in default "
                                                  f"{json.dumps(default)})"))
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


Settings = _optional_tree(ReflowConfig, "Settings")


def settings_overrides(settings: BaseModel | dict[str, Any], prefix: str = "") -> list[str]:
    """The set fields of ``settings`` as ``key.path=<TOML literal>`` overrides."""
    tree = settings.model_dump() if isinstance(settings, BaseModel) else settings
    out: list[str] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += settings_overrides(value, f"{prefix}{key}.")
        elif value is not None:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def resolve(experiment: str, settings: BaseModel | dict[str, Any]) -> ReflowConfig:
    """The config of ``configs/<experiment>.toml`` with the form's fields applied (ConfigError if invalid)."""
    return load_config(CONFIGS / f"{ExperimentFile(experiment).value}.toml", settings_overrides(settings))


@flow(name="train", log_prints=True)
def train(experiment: ExperimentFile = ExperimentFile("smoke"), settings: Settings = Settings()) -> dict[str, Any]:
    """Train a policy: the chosen experiment file, with any field of ``settings`` that is filled in."""
    cfg = resolve(experiment, settings)
    run_id = new_run_id(cfg)
    run_dir = str((Path(cfg.run.out_dir) / run_id).resolve())
    get_run_logger().info("run %s: mode=%s steps=%d, run directory %s", run_id, cfg.mode.kind,
                          cfg.run.total_steps, run_dir)
    with get_client(sync_client=True) as client:  # the UI lists the launch under the run's id, as its subflow
        client.update_flow_run(flow_run_id=FlowRunContext.get().flow_run.id, name=f"train {run_id}")
    outcome = rl_train.with_options(log_prints=True)(config_json=config_to_json(cfg), run_dir=run_dir,
                                                     run_id=run_id)
    return {"run_dir": outcome.run_dir, "mlflow_run_id": outcome.mlflow_run_id, "mlflow_ui": outcome.tracking_ui,
            "delta_tables": outcome.store_root, "final_model": outcome.final_model}


@flow(name="evaluate", log_prints=True)
def evaluate_run(run_dir: str) -> dict[str, float]:
    """Held-out accuracy of a finished run's final model (``<run_dir>/final_model``), on fresh workers."""
    run_dir = str(Path(run_dir).resolve())
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
