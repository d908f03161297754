"""What a run logs, defined once: the figures of one step and the line of ``steps.jsonl``.

Every metric a step logs is a field of one of the records below, and the
field's name is the metric's name in ``steps.jsonl``: the records travel
from the worker that measured them to the tracker as they are, and
``StepMetrics.as_dict`` flattens them. A field that is not a metric carries
``NOT_LOGGED`` in its metadata; a part, or a field, left ``None`` is one the
mode does not produce.

MLflow gets the same figures grouped by prefix, as verl's ``actor/``,
``perf/`` and ``timing_s/`` are (``mlflow_name``): ``train/loss``,
``batch/reward_mean``, ``eval/accuracy``, ``timing/update_seconds``,
``perf/generated_tokens_per_s``, ``buffer/staleness_mean``... A field's group
is its record's, any ``*_seconds`` field's is ``timing``, and a field may name
its own (``group(...)`` in its metadata); the group's name is not repeated
(``eval_accuracy`` is ``eval/accuracy``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

NOT_LOGGED = {"logged": False}


def group(name: str) -> dict[str, str]:
    """Field metadata: the field's MLflow group, where it is not its record's."""
    return {"group": name}



@dataclass(frozen=True)
class BatchStats:
    """What a batch looked like: the rewards and response lengths of its rows."""

    reward_mean: float
    accuracy: float  # share of rows whose final answer was correct
    response_length_mean: float  # tokens
    response_length_p50: float
    response_length_p99: float

    @classmethod
    def of(cls, rewards: Sequence[float], correct: Sequence[bool], lengths: Sequence[int]) -> "BatchStats":
        """The figures of these rows (all 0 for none)."""
        if not len(rewards):
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        lengths_ = np.asarray(lengths, dtype=float)
        return cls(reward_mean=float(np.mean(rewards)), accuracy=float(np.mean(correct)),
                   response_length_mean=float(lengths_.mean()), response_length_p50=float(np.percentile(lengths_, 50)),
                   response_length_p99=float(np.percentile(lengths_, 99)))


@dataclass(frozen=True)
class TrainStep:
    """One optimiser step as the trainer reports it (``policies.trainer.Trainer.step``).

    The trainer actor adds how it read the batch (``trainer_read_seconds``,
    ``trainer_batch_prefetched``) and what the batch looked like (``batch``).
    Ratios, entropy, KL and clip fraction are means over the tokens trained on.
    """

    version: int = field(metadata=NOT_LOGGED)  # weights version after the step (logged as policy_version)
    loss: float = 0.0
    kl: float = 0.0  # k3 estimate to the reference policy (0 without one)
    entropy: float = 0.0
    grad_norm: float = 0.0  # before clipping
    clip_fraction: float = 0.0
    importance_ratio_mean: float = 1.0  # exp(logp - behaviour logp)
    learning_rate: float = 0.0  # the step's rate (``train.lr_by_weight`` scales it)
    trained_tokens: int = 0  # loss tokens that went through forward and backward
    skipped_tokens: int = 0  # loss tokens of samples skipped because their gradient is exactly zero
    skipped_samples: int = field(default=0, metadata=NOT_LOGGED)
    micro_batches: int = field(default=0, metadata=NOT_LOGGED)
    trainer_seconds: float = field(default=0.0, metadata=NOT_LOGGED)  # computing the step (idle fractions use it)
    trainer_read_seconds: float = 0.0  # reading the batch from Delta and building the samples, before the step
    # the batch was read while the step before computed (streaming; None in rounds, which never prefetch)
    trainer_batch_prefetched: bool | None = field(default=False, metadata=group("perf"))
    batch: BatchStats | None = field(default=None, metadata=NOT_LOGGED)  # the rows trained on
    helpers: int = 0  # flex workers that computed gradients for the step beside the trainer (the elastic pool)
    helper_samples: int = 0  # of the samples with a gradient, those the helpers trained on


@dataclass(frozen=True)
class EvalStats:
    """Held-out accuracy of one evaluation (the warm start is step -1)."""

    step: int = field(metadata=NOT_LOGGED)
    eval_accuracy: float
    eval_reward_mean: float
    eval_response_length_mean: float
    eval_seconds: float


@dataclass(frozen=True)
class RolloutStats:
    """What one rollout round (plain or SortedRL) produced, as the score task reports it."""

    step: int = field(metadata=NOT_LOGGED)
    batch: BatchStats = field(metadata=NOT_LOGGED)  # the scored rows (the step trains on exactly these)
    samples: int = field(metadata=NOT_LOGGED)
    generated_tokens: int = field(metadata=NOT_LOGGED)  # logged per step by ``StepTimes``
    rollout_seconds: float = 0.0  # engine time spent on the round
    score_seconds: float = 0.0  # scoring and writing the trajectories
    # share of engine slot-time idle while the round was open
    rollout_bubble_ratio: float = field(default=0.0, metadata=group("perf"))
    prefill_tokens: int = 0  # prompt tokens prefilled (sorted rounds: resumed prefixes included)
    # SortedRL rounds only (None, not logged, for plain rounds):
    resumed_requests: int | None = None  # partial responses resumed
    aborted_requests: int | None = None  # requests aborted at the round's end
    cached_groups: int | None = None  # groups left in the rollout cache
    resumed_prefix_tokens: int | None = None  # resumed prefixes prefilled again
    continued_requests: int | None = None  # resumed partials still running in the engine (parked)
    tool_calls: int | None = None  # tool outputs appended (multi-turn tool use only)
    # the append's table version (-1: written by an earlier attempt)
    trajectories_delta_version: int = field(default=-1, metadata=group("storage"))


@dataclass(frozen=True)
class StreamStats:
    """What the streaming selector saw in one step: the batch's composition and the loops' state."""

    engine_tokens_per_s: float = field(metadata=group("perf"))  # generated tokens per engine-busy second
    replay_share: float  # share of the batch's samples trained on before
    reuse_mean: float
    reuse_max: float
    fresh_samples: int  # generated by the weights the step trains
    stale_samples: int  # older, never trained on
    replayed_samples: int
    concurrency_target: int = field(metadata=group("rollout"))  # in-flight requests the feeder aims for
    groups_expired: int  # written groups that aged out unused (run total)
    groups_abandoned: int  # groups given up in flight (run total)
    staleness_hist: tuple[int, ...]  # samples per age 0..max_staleness_versions (logged as staleness_hist_<age>)
    select_seconds: float = 0.0  # the step's batch query
    push_seconds: float = 0.0  # sending the weights to the engines
    previous_log_seconds: float = 0.0  # logging the step before (known only after it)
    write_seconds: float = 0.0  # the feeder's appends since the step before (scoring and Delta commits)
    writes: int = 0  # appends since the step before
    # several engines (the engines, then the flex workers): each one's in-flight target and tokens per second of its own
    # stepping since the step before (logged as <name>_<engine>; empty with one engine)
    concurrency_target_by_engine: tuple[int, ...] = field(default=(), metadata=group("rollout"))
    engine_tokens_per_s_by_engine: tuple[float, ...] = field(default=(), metadata=group("perf"))
    # the elastic pool (``resources.flex_workers``; None without one): flex workers generating and training,
    # switches since the run started, mean seconds of the switches finished since the step before
    role_generators: int | None = field(default=None, metadata=group("pool"))
    role_trainers: int | None = field(default=None, metadata=group("pool"))
    role_switches: int | None = field(default=None, metadata=group("pool"))
    switch_seconds: float | None = field(default=None, metadata=group("pool"))
    requests_moved: int | None = field(default=None, metadata=group("pool"))  # given back and resumed elsewhere


@dataclass(frozen=True)
class StepTimes:
    """Where one step's time went, and the figures every mode computes the same way."""

    step_seconds: float  # since the previous step was recorded
    update_seconds: float  # the update task, trainer and usage log
    generator_idle_fraction: float = field(metadata=group("perf"))  # share of the step the engines did not generate
    trainer_idle_fraction: float = field(metadata=group("perf"))  # share of the step the trainer did not compute
    generated_tokens: int = field(metadata=group("perf"))
    # rounds: per engine second; streaming: per step second
    generated_tokens_per_s: float = field(metadata=group("perf"))
    trained_tokens_per_s: float = field(metadata=group("perf"))  # per trainer second
    staleness_mean: float = field(metadata=group("buffer"))  # trainer version minus generating version, over the batch
    staleness_max: int = field(metadata=group("buffer"))
    policy_version: int = field(metadata=group("train"))  # after the step
    samples: int = field(metadata=group("batch"))  # trajectories trained on
    # the usage append's table version (-1: written by an earlier attempt)
    usage_delta_version: int = field(metadata=group("storage"))
    # the whole machine's, since the previous step (None: unknown)
    machine_cpu_idle_fraction: float | None = field(default=None, metadata=group("perf"))
    # share of the machine's CPU the driver process used since the previous step (orchestration, appends, queries,
    # tracking)
    driver_cpu_fraction: float | None = field(default=None, metadata=group("perf"))
    # likewise, the Prefect API server the command started (None: not known)
    prefect_server_cpu_fraction: float | None = field(default=None, metadata=group("perf"))
    sync_weights_seconds: float | None = None  # rounds: the blocking weight sync
    # one full copy of the weights, sent once per version to every engine (None: not known)
    sync_weights_bytes: int | None = field(default=None, metadata=group("perf"))


@dataclass(frozen=True)
class StepMetrics:
    """Every figure of one step; ``as_dict`` is what MLflow and ``steps.jsonl`` get."""

    batch: BatchStats
    train: TrainStep
    times: StepTimes
    rollout: RolloutStats | None = None  # rounds
    stream: StreamStats | None = None  # streaming modes
    evaluation: EvalStats | None = None  # an inline evaluation at this step
    eval_accuracy_baseline: float | None = None  # the warm start's held-out accuracy

    def as_dict(self) -> dict[str, float]:
        """Metric name -> value, parts flattened by field name; ``None`` and ``NOT_LOGGED`` fields left out."""
        out: dict[str, float] = {}
        for part in (self.batch, self.train, self.times, self.rollout, self.stream, self.evaluation):
            if part is not None:
                out.update(metric_values(part))
        if self.eval_accuracy_baseline is not None:
            out["eval_accuracy_baseline"] = self.eval_accuracy_baseline
        return out


def metric_values(record: Any) -> dict[str, float]:
    """The logged fields of one metrics record as floats (``staleness_hist`` as ``staleness_hist_<age>``)."""
    out: dict[str, float] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None or not f.metadata.get("logged", True):
            continue
        if isinstance(value, tuple):
            out.update({f"{f.name}_{i}": float(v) for i, v in enumerate(value)})
        else:
            out[f.name] = float(value)
    return out


# Each record's MLflow group (a field's own ``group(...)`` and the ``timing`` of ``*_seconds`` come first).
RECORD_GROUPS: dict[type, str] = {BatchStats: "batch", TrainStep: "train", EvalStats: "eval",
                                  RolloutStats: "rollout", StreamStats: "buffer", StepTimes: "perf"}
HISTOGRAM_PREFIX = "staleness_hist_"  # StreamStats.staleness_hist, one metric per age


@functools.cache
def _mlflow_names() -> dict[str, str]:
    names = {"eval_accuracy_baseline": "eval/accuracy_baseline"}
    for record, default in RECORD_GROUPS.items():
        for f in dataclasses.fields(record):
            if f.metadata.get("logged", True):
                name = f.metadata.get("group") or ("timing" if f.name.endswith("_seconds") else default)
                names[f.name] = f"{name}/{f.name.removeprefix(name + '_')}"
    return names


def mlflow_name(name: str) -> str:
    """The MLflow name of the metric ``name`` of ``steps.jsonl`` (``loss`` -> ``train/loss``)."""
    if name.startswith(HISTOGRAM_PREFIX):
        return f"buffer/{name}"
    return _mlflow_names().get(name, name)


def flat_name(name: str) -> str:
    """The ``steps.jsonl`` name of an MLflow metric (the inverse of ``mlflow_name``; flat names as they are)."""
    if name.startswith(f"buffer/{HISTOGRAM_PREFIX}"):
        return name.removeprefix("buffer/")
    return {v: k for k, v in _mlflow_names().items()}.get(name, name)


def mlflow_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` under their MLflow names."""
    return {mlflow_name(k): v for k, v in metrics.items()}


class StepRecord(BaseModel):
    """One line of ``steps.jsonl``: a step's metrics as logged to MLflow."""

    model_config = ConfigDict(extra="forbid")

    step: int
    policy_version: int
    elapsed_s: float
    metrics: dict[str, float]


def eval_points(steps: list[StepRecord]) -> list[tuple[float, float]]:
    """(elapsed seconds, eval accuracy) of the warm-start baseline (t=0) and of the steps that evaluated."""
    baseline = steps[0].metrics.get("eval_accuracy_baseline") if steps else None
    points = [(0.0, baseline)] if baseline is not None else []
    return points + [(r.elapsed_s, r.metrics["eval_accuracy"]) for r in steps if "eval_accuracy" in r.metrics]
