"""Tasks that open and close a run: prepare (model, workers, tracker), track, finalize."""

from __future__ import annotations

import contextvars
import dataclasses
import datetime as dt
import json
import os
import platform
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.config.load import flat_params
from reflow.config.schema import ReflowConfig
from reflow.envs.tools import run_tool_call
from reflow.infra import provenance
from reflow.infra.actors import read_weights, write_weights
from reflow.infra.placement import Placement, actor, launch_workers, start_ray, stop_workers
from reflow.infra.run import (
    RunOutcome,
    RunRecord,
    append_step,
    default_tracking_uri,
    eval_snapshot_path,
    latest_checkpoint,
    load_config_of,
    load_record,
    pending_eval_snapshots,
    read_steps,
    rewrite_steps,
    write_config,
    write_finished,
    write_record,
)
from reflow.infra.runlock import WriterLock, lock_paths
from reflow.policies.engines import engine_settings
from reflow.policies.models import resolve_model_dir
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.metrics import EvalStats, StepMetrics, StepRecord, flat_name, metric_values, mlflow_metrics
from reflow.storage.tracker import Tracker, make_tracker
from reflow.tasks import report
from reflow.tasks.context import context, mark_origin
from reflow.tasks.rollout import evaluate
from reflow.tasks.update import checkpoint

# One tracker per run, owned by the process that runs the flow (tasks run in it).
_TRACKERS: dict[str, Tracker] = {}
# The writer lock of each run this process runs (released by teardown).
_LOCKS: dict[str, WriterLock] = {}
# A resumed run: per metric key, the steps its MLflow run already holds.
_LOGGED: dict[str, dict[str, set[int]]] = {}


@task(name="prepare", cache_policy=NO_CACHE)
def prepare(cfg: ReflowConfig, run_dir: str, run_id: str, resume: bool = False) -> str:
    """Create the run directory, build/load the model, start workers and the tracker.

    ``resume``: the run directory exists (a killed attempt made it); keep its
    config and record, and reopen its MLflow run instead of creating one.
    """
    # a run killed during start-up has no record yet: it starts again in its directory
    previous = load_record(run_dir) if resume and (Path(run_dir) / "run.json").is_file() else None
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    store_root = cfg.storage.root or str(Path(run_dir).resolve() / "tables")
    # A killed attempt's lock is stale (its pid is dead) and is taken over; a live writer is refused (acquire).
    _LOCKS[run_dir] = WriterLock(lock_paths(run_dir, store_root, run_id), run_id).acquire()
    if previous is None:
        write_config(run_dir, cfg)
    model_dir = previous.model_dir if previous is not None else resolve_model_dir(cfg)
    namespace = f"reflow-{run_id}"
    tracking_uri = default_tracking_uri(cfg)
    tracker = make_tracker(tracking_uri, cfg.tracking.experiment, Path(cfg.run.out_dir))
    print(f"starting Ray and workers ({cfg.rollout.engine} engine, torch trainer)...", flush=True)
    # the tracker opens its store (a new database: about 3 s) while Ray and the workers start; the MLflow run is
    # made after them, as before: a run killed during start-up leaves none behind
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracker") as pool:
        connected = pool.submit(tracker.connect)
        start_ray(cfg, namespace, verbose=os.environ.get("REFLOW_VERBOSE") == "1")
        placement = launch_workers(cfg, namespace, model_dir, store_root, engine_settings(cfg, model_dir),
                                   run_dir=str(Path(run_dir).resolve()), run_id=run_id,
                                   tool_fn=run_tool_call if cfg.tools.max_calls else None)
        connected.result()
    if previous is not None and previous.mlflow_run_id is not None:
        tracker.resume(previous.mlflow_run_id)
        mlflow_run_id = previous.mlflow_run_id
        _LOGGED[run_dir] = {flat_name(k): steps for k, steps in tracker.logged_steps().items()}
    else:
        manifest = provenance.start_manifest(cfg.model_dump(mode="json"), run_id, model_dir,
                                             "path" if cfg.model.path else "tiny",
                                             DeltaTrajectoryStore(store_root).table_versions())
        mlflow_run_id = tracker.start(run_id, flat_params(cfg), _provenance_tags(cfg, run_dir, manifest))
        tracker.log_artifact(Path(run_dir) / "config.json", "config")
        tracker.log_artifact(provenance.write_manifest(run_dir, manifest), "reproduce")
    _TRACKERS[run_dir] = tracker
    write_record(RunRecord(run_id=run_id, run_dir=run_dir, store_root=store_root, model_dir=model_dir,
                           namespace=namespace, engines=placement.engines, trainer=placement.trainer,
                           tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id, nodes=placement.nodes,
                           weight_bytes=placement.weight_bytes))
    if len(set(placement.nodes.values())) > 1:
        print("workers on " + ", ".join(f"{name}: node {node[:8]}" for name, node in placement.nodes.items()),
              flush=True)
    return run_dir


def _provenance_tags(cfg: ReflowConfig, run_dir: str, manifest: dict) -> dict[str, str]:
    """MLflow tags: mode, run directory, code revision, package versions (the full record is the manifest)."""
    code = manifest["code"]
    tags = {"reflow.mode": cfg.mode.kind, "reflow.run_dir": str(Path(run_dir).resolve()),
            "reflow.python": platform.python_version(), "reflow.seed": str(cfg.run.seed),
            "reflow.code.package_version": str(code["package_version"]),
            "reflow.code.git_revision": str(code["git_revision"]), "reflow.code.git_dirty": str(code["git_dirty"]),
            "reflow.model.sha256": manifest["model"]["sha256"]}
    if code["diff_sha256"]:
        tags["reflow.code.diff_sha256"] = code["diff_sha256"]
    tags.update({f"reflow.pkg.{name}": str(v) for name, v in manifest["packages"].items() if v is not None})
    return tags


@task(name="prepare_eval", cache_policy=NO_CACHE)
def prepare_eval(run_dir: str) -> str:
    """Start Ray and workers holding a finished run's final model, under the names its record gives."""
    record, cfg = load_record(run_dir), load_config_of(run_dir)
    final = Path(run_dir) / "final_model"
    if not (final / "config.json").is_file():
        raise ValueError(f"{run_dir} has no final model (final_model/config.json): the run did not finish")
    start_ray(cfg, record.namespace, verbose=os.environ.get("REFLOW_VERBOSE") == "1")
    launch_workers(cfg, record.namespace, str(final), record.store_root, engine_settings(cfg, str(final)))
    return str(final)


@dataclass(frozen=True)
class Restored:
    """Where a resumed run continues."""

    first_step: int  # the first step to run (0: nothing was checkpointed)
    version: int  # trainer version restored from the checkpoint
    checkpoint: str | None


@task(name="restore", cache_policy=NO_CACHE)
def restore(run_dir: str) -> Restored:
    """Load the newest checkpoint into the trainer, give the engines its weights; the step to continue from.

    Steps after the checkpoint are run again: what a killed attempt already
    wrote for them (trajectories, usage rows, MLflow metrics, ``steps.jsonl``
    lines) is found and not written twice, and their batches are the ones it
    wrote, so the trainer replays them exactly.
    """
    rewrite_steps(run_dir, read_steps(run_dir))  # drop a line torn by the kill
    found = latest_checkpoint(run_dir)
    if found is None:
        print("resumed from the start (no checkpoint yet)", flush=True)
        return Restored(first_step=0, version=0, checkpoint=None)
    step, path = found
    ctx = context(run_dir)
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    version = ray.get(trainer.load_checkpoint.remote(str(path)))
    weights = trainer.export_weights.remote()
    ray.get([actor(name, ctx.record.namespace).update_weights.remote(weights, version) for name in ctx.record.engines])
    done = [r for r in read_steps(run_dir) if r.step <= step]
    if done:
        mark_origin(run_dir, ctx.clock.now() - done[-1].elapsed_s)  # the training clock continues
    print(f"resumed from {path.name}: step {step + 1} done, trainer version {version}", flush=True)
    return Restored(first_step=step + 1, version=version, checkpoint=str(path))


def recorded_baseline(run_dir: str) -> EvalStats | None:
    """The warm-start evaluation a killed attempt recorded with its steps (None: it recorded none)."""
    for rec in read_steps(run_dir):
        if "eval_accuracy_baseline" in rec.metrics:
            return EvalStats(step=-1, eval_accuracy=rec.metrics["eval_accuracy_baseline"],
                             eval_reward_mean=float("nan"), eval_response_length_mean=float("nan"), eval_seconds=0.0)
    return None


def log_step(run_dir: str, record: StepRecord) -> None:
    """Log one step to MLflow and ``steps.jsonl`` and print the progress line (streaming modes call it plainly,
    in ``TrackQueue``'s thread; round modes as the ``track`` task)."""
    ctx = context(run_dir)
    logged = _LOGGED.get(run_dir, {})
    fresh = {k: v for k, v in record.metrics.items() if record.step not in logged.get(k, ())}
    # a resumed step: only what was not logged yet
    _TRACKERS[run_dir].log_metrics(mlflow_metrics(fresh), step=record.step)
    resumed = run_dir in _LOGGED
    if not (resumed and any(r.step == record.step for r in read_steps(run_dir))):  # else the killed attempt did
        append_step(run_dir, record)
    print(report.progress_line(record, ctx.cfg.run.total_steps), flush=True)


track = task(name="track", cache_policy=NO_CACHE)(log_step)  # round modes: one task run per step


class TrackQueue:
    """``log_step`` in one background thread, in submission order (the streaming selector's logging).

    The selector's next update need not wait for MLflow and ``steps.jsonl``. ``drain`` waits for what was submitted and
    raises the first error a logging call hit; call it before anything that
    makes a step final (a checkpoint) or reads the log (deferred evaluation).
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="track")
        self._pending: list[Future] = []

    def submit(self, run_dir: str, record: StepRecord) -> None:
        done = [f for f in self._pending if f.done()]
        for future in done:
            self._pending.remove(future)
            future.result()  # a failed log stops the run at the next step, not at the end
        # the Prefect flow run travels in the context, as for the feeder thread
        self._pending.append(self._pool.submit(contextvars.copy_context().run, log_step, run_dir, record))

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Snapshot:
    """The trainer's weights at an eval point, kept in Ray's object store until evaluated, and on disk
    (``infra.run.eval_snapshot_path``) so that a run killed before evaluating them evaluates them on resume."""

    step: int
    version: int
    weights: object  # ray.ObjectRef
    written: object  # ray.ObjectRef of the file write (a Ray task, off the driver and the trainer)


def snapshot(run_dir: str, step: int, version: int, weights: object = None) -> Snapshot:
    """Reference the trainer's current weights, or ``weights`` (a reference to them), and start writing them to
    disk; no copy through here."""
    if weights is None:
        ctx = context(run_dir)
        weights = actor(ctx.record.trainer, ctx.record.namespace).export_weights.remote()
    path = str(eval_snapshot_path(run_dir, step))
    return Snapshot(step, version, weights, ray.remote(num_cpus=0)(write_weights).remote(weights, path, version))


def keep_step(cfg: ReflowConfig, run_dir: str, step: int, last: int, version: int,
              snapshots: list[Snapshot] | None, weights: object = None) -> None:
    """After a step: snapshot the weights (or ``weights``, a reference to them) for a deferred evaluation when one
    is due (``snapshots``: None when evaluation is inline), save a checkpoint when one is due.

    A checkpoint tells a resume that its step and those before are done, so it waits until their snapshots are
    on disk: a snapshot is written by a Ray task that may first start a worker (seconds), and a run stopped
    between the checkpoint and the file lost those steps' evaluations for good.
    """
    if snapshots is not None and cfg.eval_due(step, last):
        snapshots.append(snapshot(run_dir, step, version, weights))
    if cfg.checkpoint_due(step, last):
        if snapshots:
            ray.get([s.written for s in snapshots])
        checkpoint(run_dir, step)


class StepRecorder:
    """What the streaming selector does with a finished step: log it off the trainer's path, snapshot, checkpoint.

    ``last_step`` tells the run's last step as it is known now (a budget of
    new groups can end the run early). A checkpointed step is logged before
    its checkpoint, so a resume continues after it.
    """

    def __init__(self, cfg: ReflowConfig, run_dir: str, baseline: EvalStats | None,
                 last_step: Callable[[], int]) -> None:
        self.cfg, self.run_dir, self.baseline, self.last_step = cfg, run_dir, baseline, last_step
        self.tracks = TrackQueue()
        self.snapshots: list[Snapshot] = []

    def checkpoints(self, step: int) -> bool:
        """Whether recording ``step`` saves a checkpoint (it then uses the trainer)."""
        return self.cfg.checkpoint_due(step, self.last_step())

    def on_step(self, step: int, elapsed_s: float, metrics: StepMetrics, weights: object) -> None:
        """Step ``step`` is trained and its weights (``weights``, a reference) are on their way to the engines."""
        if self.baseline is not None:
            metrics = dataclasses.replace(metrics, eval_accuracy_baseline=self.baseline.eval_accuracy)
        version = metrics.train.version
        self.tracks.submit(self.run_dir, StepRecord(step=step, policy_version=version, elapsed_s=elapsed_s,
                                                    metrics=metrics.as_dict()))
        if self.checkpoints(step):
            self.tracks.drain()
        keep_step(self.cfg, self.run_dir, step, self.last_step(), version, self.snapshots, weights)

    def drain(self) -> None:
        self.tracks.drain()

    def close(self) -> None:
        self.tracks.close()


def abort_generation(run_dir: str) -> None:
    """Abort what the engines still have in flight (the streaming modes stop mid-stream)."""
    ctx = context(run_dir)
    ray.get([actor(name, ctx.record.namespace).abort.remote() for name in ctx.record.engines])


@task(name="evaluate_snapshots", cache_policy=NO_CACHE)
def evaluate_snapshots(run_dir: str, snapshots: list[Snapshot]) -> int:
    """Evaluate deferred snapshots, and those a killed attempt left on disk; add their figures to their steps.

    One at a time, each durably: its figures go to ``steps.jsonl`` and MLflow, then its file is removed, so a
    kill at any moment leaves every snapshot either evaluated and logged once, or on disk for the resume.
    Leaves the engines holding the trainer's current weights.
    """
    ctx = context(run_dir)
    ray.get([s.written for s in snapshots])  # every snapshot of this attempt is on disk before any is evaluated
    mine = {s.step for s in snapshots}
    reader = ray.remote(num_cpus=0, num_returns=2)(read_weights)
    pending = [(s.step, s.weights, s.version) for s in snapshots]
    for step, path in sorted(pending_eval_snapshots(run_dir).items()):  # a killed attempt's
        if step not in mine:
            weights, version = reader.remote(str(path))
            pending.append((step, weights, ray.get(version)))
    if not pending:
        return 0
    engines = [actor(name, ctx.record.namespace) for name in ctx.record.engines]
    logged = _LOGGED.get(run_dir, {})
    for step, weights, version in sorted(pending, key=lambda p: p[0]):
        steps = read_steps(run_dir)
        done = next((r.metrics for r in steps if r.step == step and "eval_accuracy" in r.metrics), None)
        if done is None:  # else evaluated before a kill that came before its file was removed
            ray.get([e.update_weights.remote(weights, version) for e in engines])
            ev = evaluate.fn(run_dir, step)
            print(f"eval step {step + 1:>4}: held-out accuracy {ev.eval_accuracy:.3f}", flush=True)
            done = metric_values(ev)
            for rec in steps:
                if rec.step == step:
                    rec.metrics.update(done)
            rewrite_steps(run_dir, steps)
        fresh = {k: v for k, v in done.items() if k.startswith("eval_") and step not in logged.get(k, ())}
        _TRACKERS[run_dir].log_metrics(mlflow_metrics(fresh), step=step)
        eval_snapshot_path(run_dir, step).unlink(missing_ok=True)
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    current = trainer.export_weights.remote()
    version = ray.get(trainer.version.remote())
    ray.get([e.update_weights.remote(current, version) for e in engines])
    return len(pending)


@task(name="finalize", cache_policy=NO_CACHE)
def finalize(run_dir: str) -> RunOutcome:
    """Final model, curves, table versions and summary: to disk, to MLflow, to stdout; then ``finished.json``."""
    ctx = context(run_dir)
    tracker = _TRACKERS[run_dir]
    final_model = ray.get(actor(ctx.record.trainer, ctx.record.namespace).save_hf.remote(
        str(Path(run_dir) / "final_model")))
    steps = read_steps(run_dir)
    png = report.plot_curves(steps, Path(run_dir) / "curves.png", f"{ctx.record.run_id} ({ctx.cfg.mode.kind})")
    versions = Path(run_dir) / "table_versions.json"
    per_step = [{"step": r.step, "trajectories": int(r.metrics.get("trajectories_delta_version", -1)),
                 "usage": int(r.metrics.get("usage_delta_version", -1))} for r in steps]
    versions.write_text(json.dumps({"store_root": ctx.record.store_root, "final": ctx.store.table_versions(),
                                    "written_per_step": per_step}, indent=2))
    manifest = provenance.finish_manifest(provenance.read_manifest(run_dir), Path(run_dir) / "checkpoints",
                                          ctx.store.table_versions(), per_step)
    manifest_path = provenance.write_manifest(run_dir, manifest)
    roles = Path(run_dir) / "roles.jsonl"  # the elastic pool's decisions (tasks.stream.ROLES_LOG)
    for path, dest in ((final_model, "final_model"), (png, None), (versions, "delta"),
                       (Path(run_dir) / "steps.jsonl", None), (manifest_path, "reproduce"),
                       *([(roles, None)] if roles.exists() else [])):
        tracker.log_artifact(path, dest)
    tracker.end("FINISHED")
    outcome = RunOutcome(run_dir=run_dir, mlflow_run_id=ctx.record.mlflow_run_id, tracking_ui=tracker.ui_url(),
                         store_root=ctx.record.store_root, curves_png=str(png), final_model=str(final_model),
                         steps=len(steps), finished_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    write_finished(outcome)  # last: `reflow resume` of this run now says it is done
    print("\n" + report.summary_table(steps), flush=True)
    return outcome


def teardown(run_dir: str, failed: bool) -> None:
    """Stop the run's actors and Ray; close the tracker as FAILED if the flow failed."""
    tracker = _TRACKERS.pop(run_dir, None)
    _LOGGED.pop(run_dir, None)
    if tracker is not None and failed:
        tracker.end("FAILED")
    lock = _LOCKS.pop(run_dir, None)
    path = Path(run_dir) / "run.json"
    try:
        if path.exists():
            rec = RunRecord.model_validate_json(path.read_text())
            stop_workers(Placement(namespace=rec.namespace, engines=rec.engines, trainer=rec.trainer))
        elif ray.is_initialized():
            ray.shutdown()
    finally:  # after the workers stopped, nothing writes any more; a Ctrl-C while they stop ends the process,
        # and its workers with it, so the lock is not left behind (a dead writer's lock is taken over, but it
        # looked like a live run to a reader)
        if lock is not None:
            lock.release()
    sys.stdout.flush()
