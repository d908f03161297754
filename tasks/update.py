"""Update, weight-sync and checkpoint tasks.

``update`` selects the step's batch with a SQL query over the trajectories
table, has the trainer actor read and train on exactly those rows, and
appends one ``usage`` row per trajectory (application transaction
``(run_id:usage, step)``), so any step's batch is recoverable by a query.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.workers import actor
from reflow.storage.sampler import sync_batch
from reflow.storage.schema import Usage
from reflow.tasks.context import context


@dataclass(frozen=True)
class UpdateSummary:
    step: int
    version: int  # trainer version after the update
    num_samples: int
    loss: float
    kl: float
    entropy: float
    grad_norm: float
    clip_fraction: float
    ratio_mean: float
    trained_tokens: int
    trainer_seconds: float
    usage_delta_version: int | None  # None: already written by an earlier attempt
    staleness_mean: float  # trainer version minus generating version, over the batch
    staleness_max: int
    seconds: float


@dataclass(frozen=True)
class SyncSummary:
    version: int
    seconds: float


@task(name="update", cache_policy=NO_CACHE)
def update(run_dir: str, step: int) -> UpdateSummary:
    """One trainer step on the batch of ``step``; logs the batch to ``usage``."""
    ctx = context(run_dir)
    start = ctx.clock.now()
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    trainer_version = ray.get(trainer.version.remote())
    batch = sync_batch(ctx.store, run_id=ctx.record.run_id, rollout_step=step)
    metrics = ray.get(trainer.train.remote(ctx.record.run_id, batch.trajectory_ids, batch.loss_weights))
    usage = [Usage(run_id=ctx.record.run_id, trajectory_id=tid, trainer_step=step, trainer_version=trainer_version,
                   loss_weight=w, staleness=trainer_version - v)
             for tid, w, v in zip(batch.trajectory_ids, batch.loss_weights, batch.policy_versions)]
    usage_version = ctx.store.append_usage(usage, app_id=f"{ctx.record.run_id}:usage", txn_version=step)
    return UpdateSummary(step=step, version=metrics.version, num_samples=len(usage), loss=metrics.loss,
                         kl=metrics.kl, entropy=metrics.entropy, grad_norm=metrics.grad_norm,
                         clip_fraction=metrics.clip_fraction, ratio_mean=metrics.ratio_mean,
                         trained_tokens=metrics.trained_tokens, trainer_seconds=metrics.seconds,
                         usage_delta_version=usage_version,
                         staleness_mean=sum(u.staleness for u in usage) / max(len(usage), 1),
                         staleness_max=max((u.staleness for u in usage), default=0),
                         seconds=ctx.clock.now() - start)


@task(name="sync_weights", cache_policy=NO_CACHE)
def sync_weights(run_dir: str, version: int) -> SyncSummary:
    """Move the trainer's weights to every engine through Ray's object store."""
    ctx = context(run_dir)
    start = ctx.clock.now()
    weights = actor(ctx.record.trainer, ctx.record.namespace).export_weights.remote()
    ray.get([actor(name, ctx.record.namespace).update_weights.remote(weights, version)
             for name in ctx.record.engines])
    return SyncSummary(version=version, seconds=ctx.clock.now() - start)


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(run_dir: str, step: int) -> str:
    """Trainer state (model, optimiser, RNG, version) under ``checkpoints/step-<N>``."""
    ctx = context(run_dir)
    path = Path(run_dir) / "checkpoints" / f"step-{step:06d}"
    return ray.get(actor(ctx.record.trainer, ctx.record.namespace).save_checkpoint.remote(str(path)))
