"""The training flow: the order of work per mode, nothing else.

* ``sync`` (verl's default): generate the whole batch, score it into Delta,
  train on it, push the new weights to the engines.
* ``one_step_off``: as soon as batch k is scored, the engine starts on batch
  k+1 with the weights it holds, while the trainer trains on batch k; the
  weight sync queues behind that round on the engine actor, so batch k+1 is
  one version stale when it is trained on.
* ``async`` and ``reflow``: two loops at once (``control.streaming``): a feeder
  thread streams whole groups from the engine into the buffer, the selector
  (this thread) trains on batches the buffer's SQL query admits and pushes
  weights without waiting; ``reflow`` also replays trained groups when fresh
  ones are short.

All modes evaluate on held-out prompts and checkpoint every few steps. With
``eval.deferred`` (always in the streaming modes) the weights are
snapshotted at each eval point and evaluated after training, so evaluation
never enters the training clock.
"""

from __future__ import annotations

from prefect import flow

from reflow.config.schema import ReflowConfig
from reflow.control.clock import SystemClock
from reflow.control.streaming import StreamingLoops
from reflow.infra.run import RunOutcome
from reflow.storage.metrics import EvalStats
from reflow.tasks.lifecycle import (
    Snapshot,
    StepRecorder,
    abort_generation,
    evaluate_snapshots,
    finalize,
    keep_step,
    prepare,
    recorded_baseline,
    restore,
    teardown,
    track,
)
from reflow.tasks.metrics import step_metrics
from reflow.tasks.rollout import evaluate, rollout, score
from reflow.tasks.sorted import sorted_round
from reflow.tasks.stream import RayFeeder, RaySelector, stream_position, trained_groups
from reflow.tasks.update import sync_weights, update

STREAMING = ("async", "reflow")


@flow(name="rl_train", flow_run_name="{run_id}", log_prints=False)
def rl_train(config: ReflowConfig, run_dir: str, run_id: str, resume: bool = False) -> RunOutcome:
    """Train a policy with GRPO as the config says; returns where the results are.

    ``config`` is a parameter of the flow run as a tree of sections (the Prefect UI shows it field by
    field); ``resume``: continue the run in ``run_dir`` from its newest checkpoint.
    """
    cfg = config
    failed = True
    try:
        prepare(cfg, run_dir, run_id, resume)
        first = restore(run_dir).first_step if resume else 0
        baseline = recorded_baseline(run_dir) if first else None
        if baseline is None and cfg.env.eval_prompts:
            baseline = evaluate(run_dir, step=-1)
        steps = _streaming if cfg.mode.kind in STREAMING else _rounds
        evaluate_snapshots(run_dir, steps(cfg, run_dir, baseline, first))
        outcome = finalize(run_dir)
        failed = False
        return outcome
    finally:
        teardown(run_dir, failed)


def _rounds(cfg: ReflowConfig, run_dir: str, baseline: EvalStats | None, first: int = 0) -> list[Snapshot]:
    """``sync`` and ``one_step_off``: one rollout round per step (a SortedRL round when scheduling says so)."""
    total, overlap = cfg.planned_steps(), cfg.mode.kind == "one_step_off"
    sorted_rounds = cfg.rollout.scheduling != "plain"
    snapshots: list[Snapshot] = []
    handle = None if sorted_rounds or first >= total else rollout(run_dir, first)
    for step in range(first, total):
        last = step == total - 1
        if sorted_rounds:  # the round started at the end of the last step (a future), or starts now
            scored = handle.result() if handle is not None else sorted_round(run_dir, step)
        else:
            scored = score(run_dir, handle)
        if overlap and not last:
            handle = rollout(run_dir, step + 1)
        updated = update(run_dir, step)
        synced = sync_weights(run_dir, updated.version)
        inline_eval = cfg.eval_due(step, total - 1) and not cfg.eval.deferred
        evaluated = evaluate(run_dir, step) if inline_eval else None
        record = step_metrics(run_dir, scored, updated, synced, evaluated, baseline)
        if not overlap and not last:  # the engine starts now; logging overlaps it
            # a sorted round is one blocking call on the engine actor: it runs as a task in Prefect's thread pool
            handle = sorted_round.submit(run_dir, step + 1) if sorted_rounds else rollout(run_dir, step + 1)
        track(run_dir, record)
        keep_step(cfg, run_dir, step, total - 1, updated.version, snapshots if cfg.eval.deferred else None)
    return snapshots


def _streaming(cfg: ReflowConfig, run_dir: str, baseline: EvalStats | None, first: int = 0) -> list[Snapshot]:
    """``async`` and ``reflow``: the feeder in a thread, the selector here, until ``total_steps`` updates or
    ``run.max_new_groups`` groups trained on.

    A resumed run (``first`` > 0, or anything already written) continues the stream after what is in Delta.
    """
    loops = StreamingLoops(cfg, SystemClock(), engines=cfg.resources.engine_actors,
                           first_step=first,
                           start=stream_position(run_dir),
                           new_groups=trained_groups(run_dir, first) if cfg.run.max_new_groups else 0)
    recorder = StepRecorder(cfg, run_dir, baseline, last_step=loops.last_step)
    feeder = RayFeeder(run_dir, keep_going=loops.running)
    selector = RaySelector(run_dir, loops.state, loops.controllers, recorder.on_step, loops.replay,
                           checkpoints=recorder.checkpoints, pool=loops.pool)
    try:
        loops.run(feeder, selector)
        recorder.drain()
    finally:
        recorder.close()
        abort_generation(run_dir)
    return recorder.snapshots
