"""The training flow: the order of work per step, nothing else.

sync mode (verl's default): generate the whole batch, score it into Delta,
train on it, push the new weights to the engines; evaluate and checkpoint
every few steps.
"""

from __future__ import annotations

from prefect import flow

from reflow.infra.config import ReflowConfig
from reflow.infra.run import StepRecord
from reflow.tasks.lifecycle import RunOutcome, finalize, prepare, teardown, track
from reflow.tasks.metrics import step_metrics
from reflow.tasks.rollout import evaluate, rollout, score
from reflow.tasks.update import checkpoint, sync_weights, update


@flow(name="rl_train", log_prints=False)
def rl_train(config_json: str, run_dir: str, run_id: str) -> RunOutcome:
    """Train a policy with GRPO as the config says; returns where the results are."""
    cfg = ReflowConfig.model_validate_json(config_json)
    total, every_eval, every_ckpt = cfg.run.total_steps, cfg.eval.every_steps, cfg.run.checkpoint_every_steps
    failed = True
    try:
        prepare(config_json, run_dir, run_id)
        baseline = evaluate(run_dir, step=-1) if cfg.env.eval_prompts else None
        for step in range(total):
            handle = rollout(run_dir, step)
            scored = score(run_dir, handle)
            updated = update(run_dir, step)
            synced = sync_weights(run_dir, updated.version)
            last = step == total - 1
            evaluated = evaluate(run_dir, step) if cfg.env.eval_prompts and ((step + 1) % every_eval == 0 or last) else None
            record: StepRecord = step_metrics(run_dir, handle, scored, updated, synced, evaluated, baseline)
            track(run_dir, record)
            if (step + 1) % every_ckpt == 0 or last:
                checkpoint(run_dir, step)
        outcome = finalize(run_dir)
        failed = False
        return outcome
    finally:
        teardown(run_dir, failed)
