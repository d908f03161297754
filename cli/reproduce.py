"""``reflow reproduce``: read a run's record from MLflow, check it, and compare a repeat against it.

The record is the manifest (``infra/provenance.py``) logged as the artifact
``reproduce/manifest.json``. Before a new run starts, the inputs are
checked: the config must validate, a ``model.path`` model must exist with
the recorded content hash, and each recorded checkpoint must exist with its
recorded hash (they are what the repeat's weights are compared against).
Code and package differences are reported, not refused.

After the repeat, every per-step metric that does not measure time is
compared (``|original - repeat| <= tolerance``), and so are the model
weights of each checkpoint both runs wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reflow.cli.runtime import preflight, quiet_environment
from reflow.cli.train import launch
from reflow.config.load import ConfigError, InputError, stored_config
from reflow.infra.provenance import (
    MANIFEST_ARTIFACT,
    code_revision,
    package_versions,
    read_manifest,
    sha256_dir,
    sha256_file,
)
from reflow.infra.run import read_steps
from reflow.infra.runs import RUN_FILE
from reflow.storage.metrics import flat_name
from reflow.storage.tracker import quiet_mlflow_logging

# Metrics that measure wall-clock time or depend on it; they differ between any two runs.
TIMING_SUFFIXES = ("_seconds", "_per_s", "_cpu_fraction")
TIMING_METRICS = frozenset({"generator_idle_fraction", "trainer_idle_fraction", "rollout_bubble_ratio",
                            "concurrency_target", "machine_cpu_idle_fraction"})


class ReproduceError(ValueError):
    """The record cannot be found or its inputs cannot be used; nothing was started."""


def is_timing_metric(name: str) -> bool:
    """Whether ``name`` measures time (excluded from the comparison)."""
    return name.endswith(TIMING_SUFFIXES) or name in TIMING_METRICS


def locate(run: str, tracking_uri: str | None, runs: str | None) -> tuple[str, str]:
    """(tracking URI, MLflow run id) for ``run``: an MLflow run id, or a run directory (its run.json says both).

    The store is ``--tracking-uri``, else ``sqlite:///<--runs>/mlflow.db``, else ``$MLFLOW_TRACKING_URI``,
    else ``runs/mlflow.db`` (the default out_dir).
    """
    if tracking_uri and runs:
        raise ReproduceError("give --tracking-uri or --runs, not both")
    run_json = Path(run) / RUN_FILE
    if run_json.is_file():
        try:
            record = json.loads(run_json.read_text())
        except (OSError, ValueError) as exc:
            raise ReproduceError(f"{run_json} is not a readable reflow run record: {exc}") from None
        recorded_uri = record.get("tracking_uri") if isinstance(record, dict) else None
        run_id = record.get("mlflow_run_id") if isinstance(record, dict) else None
        if not isinstance(recorded_uri, str) or not isinstance(run_id, str | None):
            raise ReproduceError(f"{run_json} is not a reflow run record (expected an object with tracking_uri "
                                 f"and mlflow_run_id)")
        if not run_id:
            raise ReproduceError(f"{run_json}: the run was not tracked in MLflow (tracking off); nothing to reproduce")
        return tracking_uri or recorded_uri, run_id
    if Path(run).exists():
        raise ReproduceError(f"{run!r} is a path but not a run directory (no {RUN_FILE})")
    if tracking_uri:
        return tracking_uri, run
    if runs:
        return f"sqlite:///{Path(runs).resolve() / 'mlflow.db'}", run
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], run
    return f"sqlite:///{Path('runs').resolve() / 'mlflow.db'}", run


def open_client(tracking_uri: str):
    """An MlflowClient on an existing store (a missing sqlite file is an error, never created)."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_file():
            raise ReproduceError(f"no MLflow store at {db}: pass --runs DIR (the folder the run was written "
                                 "under) or --tracking-uri URI")
        with open(db, "rb") as f:  # MLflow would write its schema into an empty file, and fail deep in a bad one
            if f.read(16) != b"SQLite format 3\x00":
                raise ReproduceError(f"{db} is not an MLflow store (not an SQLite database)")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient  # about 2.5 s: only when a command reads MLflow
    from mlflow.exceptions import MlflowException

    quiet_mlflow_logging()
    try:
        return MlflowClient(tracking_uri=tracking_uri)
    except MlflowException:
        raise ReproduceError(f"MLflow has no tracking store for {tracking_uri!r}: pass --tracking-uri with a "
                             "sqlite:///, http(s):// or database URI (or --runs DIR)") from None


def fetch_manifest(client: Any, run_id: str, tracking_uri: str) -> dict[str, Any]:
    """The run's manifest artifact; ReproduceError if the run or the artifact is missing or unreadable."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException:
        raise ReproduceError(f"no MLflow run {run_id!r} in {tracking_uri}") from None
    with tempfile.TemporaryDirectory(prefix="reflow-reproduce-") as tmp:
        try:
            local = client.download_artifacts(run_id, MANIFEST_ARTIFACT, tmp)
            manifest = json.loads(Path(local).read_text())
        except (MlflowException, OSError, ValueError) as exc:
            raise ReproduceError(f"MLflow run {run_id} has no readable {MANIFEST_ARTIFACT} (recorded by an older "
                                 f"reflow, or not a reflow run): {exc}") from None
    if not isinstance(manifest, dict) or "config" not in manifest:
        raise ReproduceError(f"MLflow run {run_id}: {MANIFEST_ARTIFACT} is not a reflow manifest")
    return manifest


def check_inputs(manifest: dict[str, Any], compare_checkpoints: bool) -> list[str]:
    """Raise ReproduceError if an input of the record is missing or changed; return warnings (code, packages)."""
    warnings: list[str] = []
    model = manifest["model"]
    if model["source"] == "path":
        path = Path(model["dir"])
        if not path.is_dir():
            raise ReproduceError(f"the run started from model {path}, which no longer exists")
        if sha256_dir(path) != model["sha256"]:
            raise ReproduceError(f"model {path} changed since the run (content hash differs from the record)")
    if compare_checkpoints:
        for ckpt in manifest.get("checkpoints", []):
            state = Path(ckpt["path"]) / "trainer.pt"
            if not state.is_file():
                raise ReproduceError(f"checkpoint of step {ckpt['step']} is missing: {state} (pass "
                                     "--no-checkpoints to reproduce without comparing weights)")
            if state.stat().st_size != ckpt["bytes"] or sha256_file(state) != ckpt["sha256"]:
                raise ReproduceError(f"checkpoint of step {ckpt['step']} is corrupt: {state} differs from the "
                                     "recorded content hash (pass --no-checkpoints to reproduce without comparing "
                                     "weights)")
    code, now = manifest.get("code", {}), code_revision()
    for key in ("git_revision", "git_dirty", "diff_sha256", "package_version"):
        if code.get(key) != now.get(key):
            warnings.append(f"code {key}: recorded {code.get(key)}, now {now.get(key)}")
    current = package_versions()
    for name, version in manifest.get("packages", {}).items():
        if current.get(name) != version:
            warnings.append(f"package {name}: recorded {version}, now {current.get(name)}")
    if not manifest.get("complete", False):
        warnings.append("the original run did not finish; only the steps it recorded are compared")
    return warnings


@dataclass
class Comparison:
    """How a repeat compares with the original."""

    tolerance: float
    steps_compared: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # metric -> largest |difference| over steps
    checkpoints: dict[int, float] = field(default_factory=dict)  # step -> largest |weight difference|
    missing: list[str] = field(default_factory=list)  # compared things one side lacks

    @property
    def matched(self) -> bool:
        """Everything compared is within the tolerance and nothing is missing."""
        worst = list(self.metrics.values()) + list(self.checkpoints.values())
        return self.steps_compared > 0 and not self.missing and all(d <= self.tolerance for d in worst)

    def to_json(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "matched": self.matched, "steps_compared": self.steps_compared,
                "max_abs_diff_per_metric": self.metrics,
                "max_abs_weight_diff_per_checkpoint": {str(k): v for k, v in self.checkpoints.items()},
                "missing": self.missing}


def _diff(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b)


def original_metrics(client: Any, run_id: str) -> dict[int, dict[str, float]]:
    """The original's per-step metrics as MLflow holds them: ``{step: {name: value}}`` (last value per step),
    under their ``steps.jsonl`` names (runs logged before MLflow's names were grouped have those already)."""
    out: dict[int, dict[str, float]] = {}
    for name in client.get_run(run_id).data.metrics:
        if is_timing_metric(flat_name(name)):
            continue
        for m in client.get_metric_history(run_id, name):
            out.setdefault(m.step, {})[flat_name(name)] = m.value
    return out


def compare(original: dict[int, dict[str, float]], repeat: dict[int, dict[str, float]],
            original_ckpts: list[dict[str, Any]], repeat_ckpts: list[dict[str, Any]], tolerance: float) -> Comparison:
    """Per-step metric differences and checkpoint weight differences between the two runs."""
    result = Comparison(tolerance=tolerance)
    for step in sorted(original):
        if step not in repeat:
            result.missing.append(f"step {step}")
            continue
        result.steps_compared += 1
        for name, value in original[step].items():
            if name not in repeat[step]:
                result.missing.append(f"step {step} metric {name}")
                continue
            result.metrics[name] = max(result.metrics.get(name, 0.0), _diff(value, repeat[step][name]))
    repeats = {c["step"]: c for c in repeat_ckpts}
    for ckpt in original_ckpts:
        if ckpt["step"] not in repeats:
            result.missing.append(f"checkpoint step {ckpt['step']}")
            continue
        result.checkpoints[ckpt["step"]] = weight_difference(Path(ckpt["path"]), Path(repeats[ckpt["step"]]["path"]))
    return result


def weight_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between the model tensors of two checkpoints (inf if they differ in shape)."""
    import torch

    sa = torch.load(a / "trainer.pt", weights_only=False, map_location="cpu")["model"]
    sb = torch.load(b / "trainer.pt", weights_only=False, map_location="cpu")["model"]
    if sa.keys() != sb.keys():
        return math.inf
    worst = 0.0
    for name, ta in sa.items():
        tb = sb[name]
        if ta.shape != tb.shape:
            return math.inf
        if ta.numel():
            worst = max(worst, float((ta.double() - tb.double()).abs().max()))
    return worst


def format_comparison(result: Comparison, original_id: str, repeat_id: str) -> str:
    """The comparison for the console."""
    lines = [f"reproduce: original {original_id} vs repeat {repeat_id}, {result.steps_compared} steps, "
             f"tolerance {result.tolerance:g} (timing metrics excluded)"]
    for name, d in sorted(result.metrics.items()):
        lines.append(f"  {name:34s} max |diff| {d:.3g}{'' if d <= result.tolerance else '  <-- differs'}")
    for step, d in sorted(result.checkpoints.items()):
        lines.append(f"  checkpoint step {step:<17d} max |weight diff| {d:.3g}"
                     f"{'' if d <= result.tolerance else '  <-- differs'}")
    for item in result.missing:
        lines.append(f"  missing in the repeat: {item}")
    lines.append("MATCHED" if result.matched else "DIFFERENT")
    return "\n".join(lines)


def cmd_reproduce(args: argparse.Namespace) -> int:
    if not 0 <= args.tolerance < float("inf"):
        raise InputError("--tolerance must be a finite number >= 0")
    try:
        tracking_uri, original_id = locate(args.run, args.tracking_uri, args.runs)
        client = open_client(tracking_uri)
        manifest = fetch_manifest(client, original_id, tracking_uri)
        try:
            cfg = stored_config(manifest["config"], "its tracked manifest")
        except ValueError as exc:
            raise ConfigError(f"the recorded config of {original_id} is not valid with this code: {exc}") from None
        # The repeat goes under --runs (else where the original went) and is tracked next to the original.
        run = cfg.run.model_copy(update={"out_dir": args.runs}) if args.runs else cfg.run
        cfg = cfg.model_copy(update={"run": run,
                                     "tracking": cfg.tracking.model_copy(update={"tracking_uri": tracking_uri})})
        preflight(cfg)
        warnings = check_inputs(manifest, compare_checkpoints=not args.no_checkpoints)
    except ReproduceError as exc:
        raise InputError(str(exc)) from None
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    quiet_environment(args.verbose)
    outcome = launch(cfg)
    return compare_repeat(args, client, original_id, manifest, outcome)


def compare_repeat(args: argparse.Namespace, client, original_id: str, manifest: dict, outcome) -> int:
    """Compare the repeat with the original; record the result in its run directory and MLflow run."""
    repeat = {r.step: {k: v for k, v in r.metrics.items() if not is_timing_metric(k)}
              for r in read_steps(outcome.run_dir)}
    checkpoints = [] if args.no_checkpoints else manifest.get("checkpoints", [])
    result = compare(original_metrics(client, original_id), repeat, checkpoints,
                     read_manifest(outcome.run_dir)["checkpoints"], args.tolerance)
    report = json.dumps({"original": original_id, "repeat": outcome.mlflow_run_id, **result.to_json()}, indent=2)
    (Path(outcome.run_dir) / "reproduce.json").write_text(report)
    if outcome.mlflow_run_id:
        client.set_tag(outcome.mlflow_run_id, "reflow.reproduces", original_id)
        client.log_text(outcome.mlflow_run_id, report, "reproduce/comparison.json")
    print("\n" + format_comparison(result, original_id, str(outcome.mlflow_run_id)), flush=True)
    return 1 if args.check and not result.matched else 0
