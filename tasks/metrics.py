"""One round step's figures (``sync``, ``one_step_off``), from the records its tasks returned."""

from __future__ import annotations

import dataclasses

from reflow.storage.metrics import EvalStats, RolloutStats, StepMetrics, StepRecord, StepTimes
from reflow.tasks.context import context, step_clock, step_control_cpu, step_cpu_idle
from reflow.tasks.update import SyncSummary, UpdateSummary


def step_metrics(run_dir: str, scored: RolloutStats, updated: UpdateSummary, synced: SyncSummary,
                 evaluated: EvalStats | None, baseline: EvalStats | None) -> StepRecord:
    """The step's record (``storage.metrics``).

    Rates are per second of the stage that did the work (engine time for
    generation, trainer time for training); idle fractions are the share of
    the step's wall time a role spent not working.
    """
    elapsed, step_s = step_clock(run_dir, context(run_dir).clock.now())
    step_s = max(step_s, 1e-9)
    driver_cpu, server_cpu = step_control_cpu(run_dir)
    train = updated.train
    times = StepTimes(
        step_seconds=step_s, update_seconds=updated.seconds, sync_weights_seconds=synced.seconds,
        sync_weights_bytes=context(run_dir).record.weight_bytes or None,
        generator_idle_fraction=max(0.0, 1.0 - scored.rollout_seconds / step_s),
        trainer_idle_fraction=max(0.0, 1.0 - train.trainer_seconds / step_s),
        generated_tokens=scored.generated_tokens,
        generated_tokens_per_s=scored.generated_tokens / max(scored.rollout_seconds, 1e-9),
        trained_tokens_per_s=train.trained_tokens / max(train.trainer_seconds, 1e-9),
        staleness_mean=updated.staleness_mean, staleness_max=updated.staleness_max, policy_version=updated.version,
        samples=scored.samples, machine_cpu_idle_fraction=step_cpu_idle(run_dir),
        driver_cpu_fraction=driver_cpu, prefect_server_cpu_fraction=server_cpu,
        usage_delta_version=updated.usage_delta_version if updated.usage_delta_version is not None else -1)
    train = dataclasses.replace(train, trainer_batch_prefetched=None)  # rounds never prefetch: not a metric here
    metrics = StepMetrics(batch=scored.batch, train=train, times=times, rollout=scored, evaluation=evaluated,
                          eval_accuracy_baseline=baseline.eval_accuracy if baseline is not None else None)
    return StepRecord(step=updated.step, policy_version=updated.version, elapsed_s=elapsed, metrics=metrics.as_dict())
