"""What a task rebuilds from a run directory (cached per process)."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from reflow.config.schema import EnvConfig, ReflowConfig
from reflow.control.clock import Clock, SystemClock
from reflow.envs.base import Env, make_env
from reflow.infra.cpu import CpuTimes, idle_fraction, read_cpu_times
from reflow.infra.prefect_api import prefect_server_pid
from reflow.infra.run import RunRecord, load_config_of, load_record
from reflow.policies.models import load_tokenizer
from reflow.storage.delta_store import DeltaTrajectoryStore


@dataclass(frozen=True)
class TaskContext:
    record: RunRecord
    cfg: ReflowConfig
    env: Env
    tokenizer: Any
    store: DeltaTrajectoryStore
    clock: Clock


# Per-process run clock marks: when the first round was submitted, when the last step was recorded.
_ORIGIN: dict[str, float] = {}
_LAST_STEP_END: dict[str, float] = {}
_LAST_CPU: dict[str, CpuTimes | None] = {}  # the machine's CPU ticks at the origin, then at the last step
# this process's CPU seconds, its Prefect server's (None: not known) and the wall clock, likewise
_LAST_CONTROL: dict[str, tuple[float, float | None, float]] = {}


def mark_origin(run_dir: str, now: float) -> None:
    """Start the run's training clock (first call wins)."""
    if run_dir not in _ORIGIN:
        _ORIGIN[run_dir] = now
        _LAST_CPU[run_dir] = read_cpu_times()
        _LAST_CONTROL[run_dir] = _control_cpu()


def step_clock(run_dir: str, now: float) -> tuple[float, float]:
    """(seconds since the training clock started, seconds since the previous step was recorded)."""
    origin = _ORIGIN.setdefault(run_dir, now)
    previous = _LAST_STEP_END.get(run_dir, origin)
    _LAST_STEP_END[run_dir] = now
    return now - origin, now - previous


def step_cpu_idle(run_dir: str) -> float | None:
    """Share of the machine's CPU time idle since the previous step (or the origin); None: unknown.

    ``infra.cpu`` says what counts. None on the first call of a process that
    never marked the origin, and where ``/proc/stat`` is missing.
    """
    now = read_cpu_times()
    before = _LAST_CPU.get(run_dir)
    _LAST_CPU[run_dir] = now
    return idle_fraction(before, now) if before is not None and now is not None else None


def _control_cpu() -> tuple[float, float | None, float]:
    pid = prefect_server_pid()
    server: float | None = None
    if pid is not None:
        try:
            times = psutil.Process(pid).cpu_times()
            server = times.user + times.system
        except psutil.Error:
            server = None
    return time.process_time(), server, time.monotonic()


def step_control_cpu(run_dir: str) -> tuple[float | None, float | None]:
    """Shares of the machine's CPU time that the control plane used since the previous step (or the origin):
    (this process, the driver: flow, tasks, loops, appends, queries, tracking; the Prefect API server it
    started). None where unknown: the first call of a process that never marked the origin, a server not
    started by this process (``PREFECT_API_URL``, or Prefect's own lazy start in tests).

    CPU seconds (every thread, delta-rs's included) over wall seconds times the machine's cores.
    """
    now = _control_cpu()
    before = _LAST_CONTROL.get(run_dir)
    _LAST_CONTROL[run_dir] = now
    if before is None or now[2] <= before[2]:
        return None, None
    machine = (now[2] - before[2]) * (os.cpu_count() or 1)
    server = (now[1] - before[1]) / machine if now[1] is not None and before[1] is not None else None
    return (now[0] - before[0]) / machine, server


@functools.lru_cache(maxsize=4)
def _env(env_json: str, seed: int, model_dir: str) -> Env:
    """The workload, built once per process (a dataset workload reads and renders its file here)."""
    return make_env(EnvConfig.model_validate_json(env_json), seed, load_tokenizer(model_dir))


@functools.lru_cache(maxsize=4)
def _store(root: str) -> DeltaTrajectoryStore:
    """One store per root and process: it keeps its tables open, one set per thread (``storage.delta_store``)."""
    return DeltaTrajectoryStore(root)


def context(run_dir: str) -> TaskContext:
    """The run's record, config, workload, tokenizer, store and clock."""
    record = load_record(run_dir)
    cfg = load_config_of(run_dir)
    return TaskContext(record=record, cfg=cfg, env=_env(cfg.env.model_dump_json(), cfg.run.seed, record.model_dir),
                       tokenizer=load_tokenizer(record.model_dir), store=_store(record.store_root),
                       clock=SystemClock())
