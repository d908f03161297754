"""One step's figures from the summaries its tasks returned."""

from __future__ import annotations

from reflow.infra.run import StepRecord
from reflow.tasks.context import context, step_clock, step_cpu_idle
from reflow.tasks.rollout import EvalSummary, ScoreSummary
from reflow.tasks.update import SyncSummary, UpdateSummary


def step_metrics(run_dir: str, scored: ScoreSummary, updated: UpdateSummary, synced: SyncSummary,
                 evaluated: EvalSummary | None, baseline: EvalSummary | None) -> StepRecord:
    """The metrics every step logs.

    Rates are per second of the stage that did the work (engine time for
    generation, trainer time for training); idle fractions are the share of
    the step's wall time a role spent not working.
    """
    elapsed, step_s = step_clock(run_dir, context(run_dir).clock.now())
    step_s = max(step_s, 1e-9)
    m = {
        "reward_mean": scored.reward_mean, "accuracy": scored.accuracy,
        "response_length_mean": scored.length_mean, "response_length_p50": scored.length_p50,
        "response_length_p99": scored.length_p99, "loss": updated.loss, "kl": updated.kl,
        "entropy": updated.entropy, "grad_norm": updated.grad_norm, "clip_fraction": updated.clip_fraction,
        "importance_ratio_mean": updated.ratio_mean, "learning_rate": updated.learning_rate,
        "generated_tokens": float(scored.generated_tokens), "trained_tokens": float(updated.trained_tokens),
        "skipped_tokens": float(updated.skipped_tokens),
        "generated_tokens_per_s": scored.generated_tokens / max(scored.generation_seconds, 1e-9),
        "trained_tokens_per_s": updated.trained_tokens / max(updated.trainer_seconds, 1e-9),
        "step_seconds": step_s, "rollout_seconds": scored.generation_seconds, "score_seconds": scored.seconds,
        "update_seconds": updated.seconds, "trainer_read_seconds": updated.read_seconds,
        "sync_weights_seconds": synced.seconds,
        "generator_idle_fraction": max(0.0, 1.0 - scored.generation_seconds / step_s),
        "trainer_idle_fraction": max(0.0, 1.0 - updated.trainer_seconds / step_s),
        "rollout_bubble_ratio": scored.bubble_ratio, "resumed_requests": float(scored.resumed),
        "aborted_requests": float(scored.aborted), "cached_groups": float(scored.cached_groups),
        "prefill_tokens": float(scored.prefill_tokens), "resumed_prefix_tokens": float(scored.resumed_tokens),
        "continued_requests": float(scored.continued),
        "tool_calls": float(scored.tool_calls),
        "elastic_token_share": scored.elastic_tokens / max(scored.generated_tokens, 1),
        "staleness_mean": updated.staleness_mean, "staleness_max": float(updated.staleness_max),
        "policy_version": float(updated.version), "samples": float(scored.num_samples),
        "trajectories_delta_version": float(scored.delta_version if scored.delta_version is not None else -1),
        "usage_delta_version": float(updated.usage_delta_version if updated.usage_delta_version is not None else -1),
    }
    cpu_idle = step_cpu_idle(run_dir)
    if cpu_idle is not None:
        m["machine_cpu_idle_fraction"] = cpu_idle
    if evaluated is not None:
        m.update({"eval_accuracy": evaluated.accuracy, "eval_reward_mean": evaluated.reward_mean,
                  "eval_response_length_mean": evaluated.length_mean, "eval_seconds": evaluated.seconds})
    if baseline is not None:
        m["eval_accuracy_baseline"] = baseline.accuracy
    return StepRecord(step=updated.step, policy_version=updated.version, elapsed_s=elapsed, metrics=m)
