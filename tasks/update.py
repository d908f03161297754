"""Update, weight-sync and checkpoint tasks.

``update`` selects the step's batch with a SQL query over the trajectories
table, has the trainer actor read and train on exactly those rows, and
appends one ``usage`` row per trajectory (application transaction
``(run_id:usage, step)``), so any step's batch is recoverable by a query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.placement import actor
from reflow.infra.run import checkpoint_dir
from reflow.storage.metrics import TrainStep
from reflow.storage.replay import ReplaySelection
from reflow.storage.sampler import BatchSelection, sync_batch
from reflow.tasks.context import TaskContext, context


@dataclass(frozen=True)
class UpdateSummary:
    """One trainer step as the update task saw it: the trainer's own record and the usage log's."""

    step: int
    train: TrainStep  # as the trainer actor returned it
    num_samples: int
    usage_delta_version: int | None  # None: already written by an earlier attempt
    staleness_mean: float  # trainer version minus generating version, over the batch
    staleness_max: int
    seconds: float  # the task's: usage log, trainer and transfer

    @property
    def version(self) -> int:
        """The trainer's version after the step."""
        return self.train.version


@dataclass(frozen=True)
class SyncSummary:
    version: int
    seconds: float


@dataclass(frozen=True)
class PendingUpdate:
    """A trainer step under way: its usage rows are committed, its result is a Ray reference."""

    step: int
    trainer_version: int  # the trainer's version when the step starts
    staleness: tuple[int, ...]  # per sample: trainer_version minus its generating version
    usage_delta_version: int | None
    result: Any  # ray.ObjectRef of the actor's TrainStep
    started: float


def batch_versions(batch: BatchSelection) -> tuple[int, int] | None:
    """Lowest and highest policy version of ``batch`` (the trainer reads only those partitions)."""
    return (min(batch.policy_versions), max(batch.policy_versions)) if batch.policy_versions else None


def prefetch_batch(run_dir: str, selection: BatchSelection) -> None:
    """Have the trainer read ``selection`` beside the step it computes (its ``read`` group); returns at once."""
    ctx = context(run_dir)
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    trainer.prefetch.options(concurrency_group="read").remote(
        ctx.record.run_id, selection.trajectory_ids, selection.loss_weights, batch_versions(selection))


def _start(run_dir: str, step: int, selection: BatchSelection | None, trainer_version: int | None,
           helpers: Sequence[str] = ()) -> PendingUpdate:
    ctx = context(run_dir)
    start = ctx.clock.now()
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    if trainer_version is None:
        trainer_version = ray.get(trainer.version.remote())
    batch = selection if selection is not None else sync_batch(ctx.store, run_id=ctx.record.run_id,
                                                               rollout_step=step)
    versions = batch_versions(batch)
    result = trainer.train.remote(ctx.record.run_id, batch.trajectory_ids, batch.loss_weights, versions,
                                  trainer_version, list(helpers))
    # The usage rows are known before the step: log them while the trainer computes (the trainer waited for
    # this commit before). A kill between the two leaves a logged step that a resume trains again, with the
    # logged batch, as it does for any step after the newest checkpoint.
    usage = batch.usage_rows(ctx.record.run_id, step, trainer_version)
    usage_version = ctx.store.append_usage(usage, app_id=f"{ctx.record.run_id}:usage", txn_version=step)
    return PendingUpdate(step=step, trainer_version=trainer_version, staleness=tuple(u.staleness for u in usage),
                         usage_delta_version=usage_version, result=result, started=start)


def finish_update(run_dir: str, pending: PendingUpdate, timeout: float | None = None) -> UpdateSummary | None:
    """The step's summary once the trainer is done; None if it is still computing after ``timeout`` seconds."""
    if timeout is not None and not ray.wait([pending.result], timeout=max(0.0, timeout))[0]:
        return None
    ctx = context(run_dir)
    staleness = pending.staleness
    return UpdateSummary(step=pending.step, train=ray.get(pending.result), num_samples=len(staleness),
                         usage_delta_version=pending.usage_delta_version,
                         staleness_mean=sum(staleness) / max(len(staleness), 1),
                         staleness_max=max(staleness, default=0),
                         seconds=ctx.clock.now() - pending.started)


@task(name="update", cache_policy=NO_CACHE)
def update(run_dir: str, step: int, selection: BatchSelection | None = None) -> UpdateSummary:
    """One trainer step; logs the batch to ``usage``.

    ``selection`` is the batch chosen by the buffer's query (streaming
    modes); None takes the whole rollout of ``step`` (sync modes). In the
    round modes every flex worker (``resources.flex_workers``) computes a
    share of the step: the rollout is over when the update runs.
    """
    ctx = context(run_dir)
    flex = [ctx.record.engines[i] for i in ctx.cfg.resources.flex_indices]
    return finish_update(run_dir, _start(run_dir, step, selection, None, flex))


@task(name="start_update", cache_policy=NO_CACHE)
def start_update(run_dir: str, step: int, selection: ReplaySelection, helpers: Sequence[str] = ()) -> PendingUpdate:
    """Start one trainer step on a buffer selection and log it to ``usage``; ``finish_update`` collects it.

    The step trains at the selection's ``trainer_version``; the trainer
    refuses it at any other version (the selector chose the batch one
    version ahead, while the step before was training). ``helpers``: names of the flex workers that compute a
    share of its gradients.
    """
    return _start(run_dir, step, selection, selection.trainer_version, helpers)


@task(name="sync_weights", cache_policy=NO_CACHE)
def sync_weights(run_dir: str, version: int) -> SyncSummary:
    """Move the trainer's weights to every engine (``resources.weight_sync``) and wait until all hold them."""
    ctx = context(run_dir)
    start = ctx.clock.now()
    weights = actor(ctx.record.trainer, ctx.record.namespace).export_weights.remote()
    ray.get(_send_weights(ctx, weights, version))
    return SyncSummary(version=version, seconds=ctx.clock.now() - start)


def _send_weights(ctx: TaskContext, weights: Any, version: int) -> list[Any]:
    """Start moving ``weights`` (a reference to the trainer's copy of ``version``) to every engine; the calls.

    ``object_store``: each engine loads the reference. ``broadcast``: the
    trainer's rank 0 broadcasts the tensors (``policies.weight_sync``) while
    each engine receives them between two of its calls.
    """
    engines = [actor(name, ctx.record.namespace) for name in ctx.record.engines]
    if ctx.cfg.resources.weight_sync == "broadcast":
        trainer = actor(ctx.record.trainer, ctx.record.namespace)
        return [trainer.broadcast_weights.options(concurrency_group="sync").remote(weights, version),
                *(e.receive_weights.remote(version) for e in engines)]
    return [e.update_weights.remote(weights, version) for e in engines]


def push_weights(run_dir: str, version: int, weights: Any = None) -> None:
    """Send the trainer's weights (or ``weights``, a reference to them) to every engine; return at once.

    Streaming modes. The engine loads them between two drain windows; the
    weights go trainer -> object store -> engine (or trainer -> engine over
    the broadcast group), never through this process.
    A plain call, not a Prefect task: it is one actor call per engine, and a
    task run of its own cost the driver and the Prefect server more CPU than
    the push (docs/concepts.md "The control plane's CPU").
    """
    ctx = context(run_dir)
    if weights is None:
        weights = actor(ctx.record.trainer, ctx.record.namespace).export_weights.remote()
    _send_weights(ctx, weights, version)


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(run_dir: str, step: int) -> str:
    """Trainer state (model, optimiser, RNG, version) under ``checkpoints/step-<N>``."""
    ctx = context(run_dir)
    path = checkpoint_dir(run_dir, step)
    return ray.get(actor(ctx.record.trainer, ctx.record.namespace).save_checkpoint.remote(str(path)))
