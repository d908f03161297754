"""The training flow: the order of work per step, nothing else.

* ``sync`` (verl's default): generate the whole batch, score it into Delta,
  train on it, push the new weights to the engines.
* ``one_step_off``: as soon as batch k is scored, the engine starts on batch
  k+1 with the weights it holds, while the trainer trains on batch k; the
  weight sync queues behind that round on the engine actor, so batch k+1 is
  one version stale when it is trained on.

Both evaluate on held-out prompts and checkpoint every few steps.
"""

from __future__ import annotations

from prefect import flow

from reflow.infra.config import ReflowConfig
from reflow.tasks.lifecycle import RunOutcome, finalize, prepare, teardown, track
from reflow.tasks.metrics import step_metrics
from reflow.tasks.rollout import evaluate, rollout, score
from reflow.tasks.update import checkpoint, sync_weights, update


@flow(name="rl_train", log_prints=False)
def rl_train(config_json: str, run_dir: str, run_id: str) -> RunOutcome:
    """Train a policy with GRPO as the config says; returns where the results are."""
    cfg = ReflowConfig.model_validate_json(config_json)
    total, overlap = cfg.run.total_steps, cfg.mode.kind == "one_step_off"
    failed = True
    try:
        prepare(config_json, run_dir, run_id)
        baseline = evaluate(run_dir, step=-1) if cfg.env.eval_prompts else None
        handle = rollout(run_dir, 0)
        for step in range(total):
            last = step == total - 1
            scored = score(run_dir, handle)
            if overlap and not last:
                handle = rollout(run_dir, step + 1)
            updated = update(run_dir, step)
            synced = sync_weights(run_dir, updated.version)
            due_eval = cfg.env.eval_prompts and ((step + 1) % cfg.eval.every_steps == 0 or last)
            evaluated = evaluate(run_dir, step) if due_eval else None
            track(run_dir, step_metrics(run_dir, scored, updated, synced, evaluated, baseline))
            if (step + 1) % cfg.run.checkpoint_every_steps == 0 or last:
                checkpoint(run_dir, step)
            if not overlap and not last:
                handle = rollout(run_dir, step + 1)
        outcome = finalize(run_dir)
        failed = False
        return outcome
    finally:
        teardown(run_dir, failed)
