"""The training flow: the order of work per mode, nothing else.

* ``sync`` (verl's default): generate the whole batch, score it into Delta,
  train on it, push the new weights to the engines.
* ``one_step_off``: as soon as batch k is scored, the engine starts on batch
  k+1 with the weights it holds, while the trainer trains on batch k; the
  weight sync queues behind that round on the engine actor, so batch k+1 is
  one version stale when it is trained on.
* ``async`` and ``reflow``: two loops at once (``infra.loops``): a feeder
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

import contextvars
import threading

from prefect import flow

from reflow.infra.clock import SystemClock
from reflow.infra.config import ReflowConfig
from reflow.infra.loops import ConcurrencyController, FeederLoop, LoopState, StalenessGate
from reflow.infra.selector import SelectorLoop
from reflow.tasks.lifecycle import (RunOutcome, abort_generation, evaluate_snapshots, finalize, prepare,
                                    recorded_baseline, restore, snapshot, teardown, track, TrackQueue)
from reflow.tasks.metrics import step_metrics
from reflow.tasks.rollout import evaluate, rollout, score
from reflow.tasks.sorted import sorted_round
from reflow.tasks.stream import RayFeeder, RaySelector, stream_position, trained_groups
from reflow.tasks.update import checkpoint, sync_weights, update

STREAMING = ("async", "reflow")


@flow(name="rl_train", log_prints=False)
def rl_train(config_json: str, run_dir: str, run_id: str, resume: bool = False) -> RunOutcome:
    """Train a policy with GRPO as the config says; returns where the results are.

    ``resume``: continue the run in ``run_dir`` from its newest checkpoint.
    """
    cfg = ReflowConfig.model_validate_json(config_json)
    failed = True
    try:
        prepare(config_json, run_dir, run_id, resume)
        first = restore(run_dir).first_step if resume else 0
        baseline = recorded_baseline(run_dir) if first else None
        if baseline is None and cfg.env.eval_prompts:
            baseline = evaluate(run_dir, step=-1)
        if cfg.mode.kind in STREAMING:
            snapshots = _streaming(cfg, run_dir, baseline, first)
        else:
            snapshots = _rounds(cfg, run_dir, baseline, first)
        evaluate_snapshots(run_dir, snapshots)
        outcome = finalize(run_dir)
        failed = False
        return outcome
    finally:
        teardown(run_dir, failed)


def _due_eval(cfg: ReflowConfig, step: int, last: int) -> bool:
    """Whether ``step`` is evaluated (``last``: the run's last step, which always is)."""
    return bool(cfg.env.eval_prompts) and ((step + 1) % cfg.eval.every_steps == 0 or step == last)


def _after_step(cfg: ReflowConfig, run_dir: str, step: int, last: int, version: int, snapshots: list | None,
                weights: object = None) -> None:
    """Snapshot the weights (or ``weights``, a reference to them) for a deferred evaluation (``snapshots``: None
    when evaluation is inline), checkpoint."""
    if snapshots is not None and _due_eval(cfg, step, last):
        snapshots.append(snapshot(run_dir, step, version, weights))
    if _due_checkpoint(cfg, step, last):
        checkpoint(run_dir, step)


def _due_checkpoint(cfg: ReflowConfig, step: int, last: int) -> bool:
    return (step + 1) % cfg.run.checkpoint_every_steps == 0 or step == last


def _rounds(cfg: ReflowConfig, run_dir: str, baseline, first: int = 0) -> list:
    """``sync`` and ``one_step_off``: one rollout round per step (a SortedRL round when scheduling says so)."""
    total, overlap = cfg.planned_steps(), cfg.mode.kind == "one_step_off"
    sorted_rounds = cfg.rollout.scheduling != "plain"
    snapshots: list = []
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
        inline_eval = _due_eval(cfg, step, total - 1) and not cfg.eval.deferred
        evaluated = evaluate(run_dir, step) if inline_eval else None
        record = step_metrics(run_dir, scored, updated, synced, evaluated, baseline)
        if not overlap and not last:  # the engine starts now; logging overlaps it
            # a sorted round is one blocking call on the engine actor: it runs as a task in Prefect's thread pool
            handle = sorted_round.submit(run_dir, step + 1) if sorted_rounds else rollout(run_dir, step + 1)
        track(run_dir, record)
        _after_step(cfg, run_dir, step, total - 1, updated.version, snapshots if cfg.eval.deferred else None)
    return snapshots


def _streaming(cfg: ReflowConfig, run_dir: str, baseline, first: int = 0) -> list:
    """``async`` and ``reflow``: the feeder in a thread, the selector here, until ``total_steps`` updates or
    ``run.max_new_groups`` groups trained on.

    A resumed run (``first`` > 0, or anything already written) continues the stream after what is in Delta.
    """
    b, c, groups = cfg.buffer, cfg.concurrency, cfg.rollout.prompts_per_step
    replay = cfg.mode.kind == "reflow"
    fresh_per_step = cfg.fresh_groups_per_step()
    clock = SystemClock()
    state = LoopState()
    engines = 1 + cfg.resources.elastic_engines  # the target is the pool's: each engine's share scales with it
    initial = c.initial_sequences * engines
    maximum = cfg.rollout.max_concurrent_sequences * engines if c.adaptive else initial
    minimum = c.min_sequences if c.adaptive else initial
    controller = ConcurrencyController(initial, minimum, maximum, c.increase, c.decrease, window_s=c.window_s)
    # The gate counts whole batches in both modes: reflow trains on fresh groups first, so it consumes a full
    # batch of them whenever they are there, and a gate sized by its minimum fresh share starves the engine.
    # Appends of a quarter batch (or one a second) in both modes: each is a Prefect task run and a Delta commit
    # on the control plane's CPU, which the engine shares. Sized by reflow's fresh share (a quarter of 16 groups),
    # reflow appended 4.8 groups at a time; now 6.4, async 6.7 (2026-12-02, configs/bench.toml).
    backend = RayFeeder(run_dir, keep_going=lambda: not state.stop)
    feeder = FeederLoop(backend, state, StalenessGate(b.max_staleness_versions, groups, groups),
                        controller, clock, window_s=b.drain_window_s,
                        write_min_groups=max(1, groups // 4), batch_unused_groups=fresh_per_step)
    at = stream_position(run_dir)
    feeder.resume_at(at.next_group, at.next_chunk)
    # one update per step: the restored trainer's version is the number of steps done
    state.trainer_version, state.groups_submitted, state.groups_written = first, at.next_group, at.written_groups
    state.unused.update(at.unused)
    snapshots: list = []

    tracks = TrackQueue()

    def last() -> int:  # the run's last step: total_steps - 1, or the one that spent run.max_new_groups
        return selector.final_step if selector.final_step is not None else cfg.run.total_steps - 1

    def on_step(step, selection, updated, record, weights) -> None:
        if baseline is not None:
            record.metrics["eval_accuracy_baseline"] = baseline.accuracy
        tracks.submit(run_dir, record)  # off the trainer's path
        if _due_checkpoint(cfg, step, last()):
            tracks.drain()  # a checkpointed step is logged: a resume continues after it
        _after_step(cfg, run_dir, step, last(), updated.version, snapshots, weights)

    selector = SelectorLoop(RaySelector(run_dir, state, controller, on_step, replay, backend.tokens_by_engine,
                                        checkpoints=lambda step: _due_checkpoint(cfg, step, last())),
                            state, groups, clock, min_unused_groups=fresh_per_step,
                            select_ahead=replay and b.select_ahead and b.max_staleness_versions > 0,
                            max_new_groups=cfg.run.max_new_groups,
                            new_groups=trained_groups(run_dir, first) if cfg.run.max_new_groups else 0)
    # The feeder's tasks run in its thread inside this flow run (the context carries the run).
    thread = threading.Thread(target=contextvars.copy_context().run, args=(feeder.run,), name="feeder", daemon=True)
    thread.start()
    try:
        selector.run(range(first, cfg.run.total_steps))
        tracks.drain()
    finally:
        state.request_stop()
        thread.join()
        tracks.close()
        abort_generation(run_dir)
    if state.error is not None:
        raise RuntimeError("the feeder loop failed") from state.error
    return snapshots
