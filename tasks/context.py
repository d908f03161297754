"""What a task rebuilds from a run directory (cached per process)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from reflow.envs.base import Env, make_env
from reflow.infra.clock import Clock, SystemClock
from reflow.infra.config import ReflowConfig
from reflow.infra.run import RunRecord, load_config_of, load_record
from reflow.storage.delta_store import DeltaTrajectoryStore


@dataclass(frozen=True)
class TaskContext:
    record: RunRecord
    cfg: ReflowConfig
    env: Env
    tokenizer: Any
    store: DeltaTrajectoryStore
    clock: Clock


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def context(run_dir: str) -> TaskContext:
    """The run's record, config, workload, tokenizer, store and clock."""
    record = load_record(run_dir)
    cfg = load_config_of(run_dir)
    return TaskContext(record=record, cfg=cfg, env=make_env(cfg.env, cfg.run.seed),
                       tokenizer=_tokenizer(record.model_dir), store=DeltaTrajectoryStore(record.store_root),
                       clock=SystemClock())
