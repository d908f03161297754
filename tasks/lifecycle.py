"""Tasks that open and close a run: prepare (model, workers, tracker), track, finalize."""

from __future__ import annotations

import contextvars
import json
import os
import platform
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra import provenance, report
from reflow.infra.config import ReflowConfig, flat_params
from reflow.infra.run import (RunRecord, StepRecord, append_step, default_tracking_uri, latest_checkpoint,
                              load_config_of, load_record, read_steps, rewrite_steps, write_config, write_record)
from reflow.infra.runlock import WriterLock, lock_paths
from reflow.infra.workers import Placement, actor, launch_workers, start_ray, stop_workers
from reflow.policies.engines import EngineSettings, model_max_len
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.tracker import Tracker, make_tracker
from reflow.tasks.context import _tokenizer, context, mark_origin

if TYPE_CHECKING:
    from reflow.tasks.rollout import EvalSummary

# One tracker per run, owned by the process that runs the flow (tasks run in it).
_TRACKERS: dict[str, Tracker] = {}
# The writer lock of each run this process runs (released by teardown).
_LOCKS: dict[str, WriterLock] = {}
# A resumed run: per metric key, the steps its MLflow run already holds.
_LOGGED: dict[str, dict[str, set[int]]] = {}


def resolve_model_dir(cfg: ReflowConfig, progress=print) -> str:
    """``model.path`` or the (cached) tiny warm-started policy."""
    if cfg.model.path:
        return str(Path(cfg.model.path).resolve())
    from reflow.policies.tiny import ensure_tiny_model

    return str(ensure_tiny_model(cfg.model, cfg.env, cfg.run.seed, progress=progress,
                                 threads=cfg.resources.torch_threads).resolve())


def _engine_settings(cfg: ReflowConfig, model_dir: str) -> EngineSettings:
    tok = _tokenizer(model_dir)
    return EngineSettings(model_dir=model_dir, dtype=cfg.model.dtype, temperature=cfg.rollout.temperature,
                          eos_token_id=int(tok.eos_token_id), max_model_len=model_max_len(model_dir),
                          max_concurrent_sequences=cfg.rollout.max_concurrent_sequences, seed=cfg.run.seed,
                          kv_cache_gib=cfg.rollout.kv_cache_gib, enforce_eager=cfg.rollout.enforce_eager,
                          threads=cfg.resources.torch_threads, keep_kv_on_update=cfg.rollout.kv_on_update == "keep",
                          cpu_linear=cfg.rollout.cpu_linear, warm_up=cfg.rollout.warm_up)


@task(name="prepare", cache_policy=NO_CACHE)
def prepare(config_json: str, run_dir: str, run_id: str, resume: bool = False) -> str:
    """Create the run directory, build/load the model, start workers and the tracker.

    ``resume``: the run directory exists (a killed attempt made it); keep its
    config and record, and reopen its MLflow run instead of creating one.
    """
    cfg = ReflowConfig.model_validate_json(config_json)
    previous = load_record(run_dir) if resume else None
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    store_root = cfg.storage.root or str(Path(run_dir).resolve() / "tables")
    # A killed attempt's lock is stale (its pid is dead) and is taken over; a live writer is refused.
    _LOCKS[run_dir] = WriterLock(lock_paths(run_dir, store_root, run_id), run_id).acquire()
    if previous is None:
        write_config(run_dir, cfg)
    model_dir = previous.model_dir if previous is not None else resolve_model_dir(cfg)
    namespace = f"reflow-{run_id}"
    print(f"starting Ray and workers ({cfg.rollout.engine} engine, torch trainer)...", flush=True)
    start_ray(cfg, namespace, verbose=os.environ.get("REFLOW_VERBOSE") == "1")
    tool_fn = None
    if cfg.tools.max_calls:
        from reflow.envs.tools import run_tool_call as tool_fn
    placement = launch_workers(cfg, namespace, model_dir, store_root, _engine_settings(cfg, model_dir),
                               run_dir=str(Path(run_dir).resolve()), run_id=run_id, tool_fn=tool_fn)
    tracking_uri = default_tracking_uri(cfg)
    tracker = make_tracker(tracking_uri, cfg.tracking.experiment, Path(cfg.run.out_dir))
    if previous is not None and previous.mlflow_run_id is not None:
        tracker.resume(previous.mlflow_run_id)
        mlflow_run_id = previous.mlflow_run_id
        _LOGGED[run_dir] = tracker.logged_steps()
    else:
        manifest = provenance.start_manifest(json.loads(config_json), run_id, model_dir,
                                             "path" if cfg.model.path else "tiny",
                                             DeltaTrajectoryStore(store_root).table_versions())
        mlflow_run_id = tracker.start(run_id, flat_params(cfg), _provenance_tags(cfg, run_dir, manifest))
        tracker.log_artifact(Path(run_dir) / "config.json", "config")
        tracker.log_artifact(provenance.write_manifest(run_dir, manifest), "reproduce")
    _TRACKERS[run_dir] = tracker
    write_record(RunRecord(run_id=run_id, run_dir=run_dir, store_root=store_root, model_dir=model_dir,
                           namespace=namespace, engines=placement.engines, trainer=placement.trainer,
                           tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id))
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
    launch_workers(cfg, record.namespace, str(final), record.store_root, _engine_settings(cfg, str(final)))
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


def recorded_baseline(run_dir: str) -> "EvalSummary | None":
    """The warm-start evaluation a killed attempt recorded with its steps (None: it recorded none)."""
    from reflow.tasks.rollout import EvalSummary

    for rec in read_steps(run_dir):
        if "eval_accuracy_baseline" in rec.metrics:
            return EvalSummary(step=-1, accuracy=rec.metrics["eval_accuracy_baseline"], reward_mean=float("nan"),
                               length_mean=float("nan"), seconds=0.0)
    return None


@task(name="track", cache_policy=NO_CACHE)
def track(run_dir: str, record: StepRecord) -> None:
    """Log one step to MLflow and ``steps.jsonl`` and print the progress line."""
    ctx = context(run_dir)
    logged = _LOGGED.get(run_dir, {})
    fresh = {k: v for k, v in record.metrics.items() if record.step not in logged.get(k, ())}
    _TRACKERS[run_dir].log_metrics(fresh, step=record.step)  # a resumed step: only what was not logged yet
    resumed = run_dir in _LOGGED
    if not (resumed and any(r.step == record.step for r in read_steps(run_dir))):  # else the killed attempt did
        append_step(run_dir, record)
    print(report.progress_line(record, ctx.cfg.run.total_steps), flush=True)


class TrackQueue:
    """``track`` in one background thread, in submission order (the streaming selector's logging).

    The selector's next update need not wait for MLflow, ``steps.jsonl``
    and a Prefect task run. ``drain`` waits for what was submitted and
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
        self._pending.append(self._pool.submit(contextvars.copy_context().run, track, run_dir, record))

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Snapshot:
    """The trainer's weights at an eval point, kept in Ray's object store until evaluated."""

    step: int
    version: int
    weights: object  # ray.ObjectRef


def snapshot(run_dir: str, step: int, version: int, weights: object = None) -> Snapshot:
    """Reference the trainer's current weights, or ``weights`` (a reference to them); no copy through here."""
    if weights is None:
        ctx = context(run_dir)
        weights = actor(ctx.record.trainer, ctx.record.namespace).export_weights.remote()
    return Snapshot(step, version, weights)


def abort_generation(run_dir: str) -> None:
    """Abort what the engines still have in flight (the streaming modes stop mid-stream)."""
    ctx = context(run_dir)
    ray.get([actor(name, ctx.record.namespace).abort.remote() for name in ctx.record.engines])


@task(name="evaluate_snapshots", cache_policy=NO_CACHE)
def evaluate_snapshots(run_dir: str, snapshots: list[Snapshot]) -> int:
    """Evaluate deferred snapshots; add their figures to their steps (``steps.jsonl`` and MLflow).

    Leaves the engines holding the trainer's current weights.
    """
    if not snapshots:
        return 0
    from reflow.tasks.rollout import evaluate

    ctx = context(run_dir)
    engines = [actor(name, ctx.record.namespace) for name in ctx.record.engines]
    figures: dict[int, dict[str, float]] = {}
    for snap in snapshots:
        ray.get([e.update_weights.remote(snap.weights, snap.version) for e in engines])
        ev = evaluate.fn(run_dir, snap.step)
        figures[snap.step] = {"eval_accuracy": ev.accuracy, "eval_reward_mean": ev.reward_mean,
                              "eval_response_length_mean": ev.length_mean, "eval_seconds": ev.seconds}
        print(f"eval step {snap.step + 1:>4}: held-out accuracy {ev.accuracy:.3f}", flush=True)
    trainer = actor(ctx.record.trainer, ctx.record.namespace)
    current = trainer.export_weights.remote()
    version = ray.get(trainer.version.remote())
    ray.get([e.update_weights.remote(current, version) for e in engines])
    steps = read_steps(run_dir)
    for rec in steps:
        if rec.step in figures:
            rec.metrics.update(figures[rec.step])
            _TRACKERS[run_dir].log_metrics(figures[rec.step], step=rec.step)
    rewrite_steps(run_dir, steps)
    return len(figures)


@dataclass(frozen=True)
class RunOutcome:
    run_dir: str
    mlflow_run_id: str | None
    tracking_ui: str
    store_root: str
    curves_png: str
    final_model: str


@task(name="finalize", cache_policy=NO_CACHE)
def finalize(run_dir: str) -> RunOutcome:
    """Final model, curves, table versions and summary: to disk, to MLflow, to stdout."""
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
    for path, dest in ((final_model, "final_model"), (png, None), (versions, "delta"),
                       (Path(run_dir) / "steps.jsonl", None), (manifest_path, "reproduce")):
        tracker.log_artifact(path, dest)
    tracker.end("FINISHED")
    outcome = RunOutcome(run_dir=run_dir, mlflow_run_id=ctx.record.mlflow_run_id, tracking_ui=tracker.ui_url(),
                         store_root=ctx.record.store_root, curves_png=str(png), final_model=str(final_model))
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
    if path.exists():
        rec = RunRecord.model_validate_json(path.read_text())
        stop_workers(Placement(namespace=rec.namespace, engines=rec.engines, trainer=rec.trainer))
    elif ray.is_initialized():
        ray.shutdown()
    if lock is not None:  # after the workers stopped: nothing writes any more
        lock.release()
    sys.stdout.flush()
