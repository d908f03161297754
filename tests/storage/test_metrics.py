"""Metric names: flat in steps.jsonl, grouped by prefix in MLflow, one-to-one."""

from __future__ import annotations

import dataclasses

from reflow.storage import metrics as m
from reflow.storage.metrics import flat_name, mlflow_metrics, mlflow_name

GROUPS = {"batch", "train", "eval", "rollout", "buffer", "perf", "timing", "storage"}


def _step() -> m.StepMetrics:
    batch = m.BatchStats.of([1.0, 0.0], [True, False], [3, 5])
    times = m.StepTimes(step_seconds=2.0, update_seconds=1.0, generator_idle_fraction=0.1, trainer_idle_fraction=0.2,
                      generated_tokens=8, generated_tokens_per_s=4.0, trained_tokens_per_s=5.0,
                      staleness_mean=0.5, staleness_max=1, policy_version=3, samples=2,
                      usage_delta_version=4)
    stream = m.StreamStats(engine_tokens_per_s=9.0, replay_share=0.5, reuse_mean=1.5, reuse_max=2, fresh_samples=1,
                         stale_samples=0, replayed_samples=1, concurrency_target=16, groups_expired=0,
                         groups_abandoned=0, staleness_hist=(1, 1))
    return m.StepMetrics(batch=batch, train=m.TrainStep(version=3, loss=0.25), times=times, stream=stream,
                       evaluation=m.EvalStats(step=2, eval_accuracy=0.5, eval_reward_mean=0.5,
                                            eval_response_length_mean=4.0, eval_seconds=1.0),
                       eval_accuracy_baseline=0.3)


def test_every_logged_metric_has_one_grouped_name_and_back() -> None:
    flat = _step().as_dict()
    grouped = mlflow_metrics(flat)
    assert len(grouped) == len(flat)  # no two metrics share an MLflow name
    assert {name.split("/")[0] for name in grouped} <= GROUPS and all(name.count("/") == 1 for name in grouped)
    assert {flat_name(name): value for name, value in grouped.items()} == flat
    assert (grouped["train/loss"] == 0.25 and grouped["eval/accuracy"] == 0.5
            and grouped["eval/accuracy_baseline"] == 0.3)
    assert grouped["timing/step_seconds"] == 2.0 and grouped["buffer/staleness_hist_1"] == 1.0
    assert grouped["perf/generated_tokens_per_s"] == 4.0 and grouped["batch/reward_mean"] == 0.5
    # every field of every record, logged or not in this step, has a name of its own
    names = [mlflow_name(f.name) for record in m.RECORD_GROUPS for f in dataclasses.fields(record)
             if f.metadata.get("logged", True)]
    assert len(names) == len(set(names)) and all("/" in n for n in names)


def test_names_of_runs_logged_before_grouping_read_as_they_are() -> None:
    assert flat_name("loss") == "loss" and flat_name("staleness_hist_0") == "staleness_hist_0"
    assert mlflow_name("not_a_metric") == "not_a_metric"
