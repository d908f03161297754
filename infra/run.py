"""A run's identity and the references its tasks pass around.

The run directory holds ``run.json`` (this ``RunRecord``), ``config.json``
(the resolved config), ``steps.jsonl`` (one ``StepRecord`` per step),
``given_up.jsonl`` (the streaming modes: the lengths of the finished
samples of groups given up in flight), checkpoints, the final model and,
by default, the Delta tables, and, written last once the run has
finished, ``finished.json`` (its ``RunOutcome``). Tasks receive the run
directory and load everything else from it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from reflow.config.load import InputError, config_to_json, format_errors, stored_config
from reflow.config.schema import ReflowConfig
from reflow.storage.metrics import StepRecord


class RunRecord(BaseModel):
    """Everything a task needs to find the run's workers, tables and tracker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    run_dir: str
    store_root: str
    model_dir: str
    namespace: str
    engines: tuple[str, ...]
    trainer: str
    tracking_uri: str
    mlflow_run_id: str | None = None
    nodes: dict[str, str] = {}  # actor name -> Ray node id it started on
    weight_bytes: int = 0  # one full copy of the policy's weights, what each weight sync moves (0: not known)


class RunOutcome(BaseModel):
    """Where a finished run's results are: what ``reflow run`` prints, and ``finished.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str
    mlflow_run_id: str | None
    tracking_ui: str
    store_root: str
    curves_png: str
    final_model: str
    steps: int = 0  # steps trained
    finished_at: str = ""  # UTC, ISO 8601


FINISHED = "finished.json"


def write_finished(outcome: RunOutcome) -> Path:
    """Mark the run finished: the last thing a run writes, after its final model and its MLflow run's end."""
    path = Path(outcome.run_dir) / FINISHED
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(outcome.model_dump_json(indent=2))
    tmp.replace(path)
    return path


def read_finished(run_dir: Path) -> RunOutcome | None:
    """The outcome of a run that finished; None while it has not (or finished before this marker existed)."""
    path = run_dir / FINISHED
    if not path.is_file():
        return None
    try:
        return RunOutcome.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise InputError(format_errors(exc, f"{path}: not a reflow run outcome")) from None
    except OSError as exc:
        raise InputError(f"{path}: {exc}") from None


def new_run_id(cfg: ReflowConfig) -> str:
    """``<name>-<UTC timestamp>`` (also the run directory's name)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    return f"{cfg.run.name}-{stamp}"


def find_run(run: str, runs: str | None) -> Path:
    """The directory of run ``run`` (a path, or a run id under ``runs``); InputError if it is not a run.

    A run's directory holds ``config.json`` from its first moment; ``run.json``
    follows once its workers have started, so a run killed during start-up
    has only the config, and is resumed from it.
    """
    candidates = [Path(run)] + ([Path(runs) / run] if runs and not Path(run).is_absolute() else [])
    for path in candidates:
        if (path / "config.json").is_file():
            return path.resolve()
    raise InputError(f"{run!r} is not a run directory (no config.json in "
                     f"{' or '.join(str(p) for p in candidates)})")


def find_finished_run(run: str, runs: str | None) -> Path:
    """As ``find_run``, for a run that finished (has its final model); InputError otherwise."""
    run_dir = find_run(run, runs)
    if not (run_dir / "final_model" / "config.json").is_file() or not (run_dir / "run.json").is_file():
        raise InputError(f"{run_dir} has no final model (final_model/config.json): the run did not finish; "
                         "`reflow resume` it first")
    for name, read in (("run.json", load_record), ("config.json", load_config_of)):
        try:
            read(str(run_dir))
        except ValidationError as exc:
            raise InputError(format_errors(exc, f"{run_dir / name}: not a reflow run record")) from None
        except (OSError, ValueError) as exc:  # unreadable, not JSON, or a config this code refuses
            raise InputError(f"{run_dir / name}: {exc}") from None
    return run_dir


def default_tracking_uri(cfg: ReflowConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return f"sqlite:///{Path(cfg.run.out_dir).resolve() / 'mlflow.db'}"


def write_record(record: RunRecord) -> None:
    path = Path(record.run_dir) / "run.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(path)
    load_record.cache_clear()


def write_config(run_dir: str | Path, cfg: ReflowConfig) -> Path:
    path = Path(run_dir) / "config.json"
    path.write_text(config_to_json(cfg))
    return path


@functools.lru_cache(maxsize=8)
def load_record(run_dir: str) -> RunRecord:
    return RunRecord.model_validate_json((Path(run_dir) / "run.json").read_text())


@functools.lru_cache(maxsize=8)
def load_config_of(run_dir: str) -> ReflowConfig:
    path = Path(run_dir) / "config.json"
    return stored_config(path.read_text(), str(path))


def append_step(run_dir: str | Path, record: StepRecord) -> None:
    with open(Path(run_dir) / "steps.jsonl", "a") as fh:
        fh.write(record.model_dump_json() + "\n")


def read_steps(run_dir: str | Path) -> list[StepRecord]:
    """The recorded steps; a torn last line (the process was killed while appending it) is left out."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line]
    steps = []
    for i, line in enumerate(lines):
        try:
            steps.append(StepRecord.model_validate(json.loads(line)))
        except ValueError:
            if i < len(lines) - 1:
                raise
    return steps


GIVEN_UP_LOG = "given_up.jsonl"


def append_given_up(run_dir: str | Path, lengths: dict[int, list[int]]) -> None:
    """Record response lengths of finished samples of groups given up in flight, by the group's stream position
    (a group may have several lines: its samples that finish after it was given up come later)."""
    with open(Path(run_dir) / GIVEN_UP_LOG, "a") as fh:
        fh.writelines(json.dumps({"position": g, "lengths": n}) + "\n" for g, n in sorted(lengths.items()))


def read_given_up(run_dir: str | Path) -> dict[int, list[int]]:
    """Stream position -> the response lengths of the samples that finished of each group a run gave up in
    flight (``append_given_up``; a torn last line is left out); empty for a run that gave up none."""
    path = Path(run_dir) / GIVEN_UP_LOG
    if not path.exists():
        return {}
    lines = [line for line in path.read_text().splitlines() if line]
    out: dict[int, list[int]] = {}
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            if i < len(lines) - 1:
                raise
            continue
        out.setdefault(int(entry["position"]), []).extend(int(n) for n in entry["lengths"])
    return out


CHECKPOINT_PREFIX = "step-"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where the trainer state after ``step`` is saved."""
    return Path(run_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint, or None.

    Checkpoints are written to ``step-N.tmp`` and renamed, so a directory
    named ``step-N`` holding ``trainer.pt`` is complete.
    """
    found = []
    for path in (Path(run_dir) / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = path.name.removeprefix(CHECKPOINT_PREFIX)
        if suffix.isdigit() and (path / "trainer.pt").is_file():
            found.append((int(suffix), path))
    return max(found) if found else None


def rewrite_steps(run_dir: str | Path, steps: list[StepRecord]) -> None:
    """Replace ``steps.jsonl`` atomically (deferred evaluations add figures to past steps)."""
    path = Path(run_dir) / "steps.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(r.model_dump_json() + "\n" for r in steps))
    tmp.replace(path)


EVAL_SNAPSHOTS = "eval_snapshots"


def eval_snapshot_path(run_dir: str | Path, step: int) -> Path:
    """Where the weights of a deferred evaluation at ``step`` wait for it (a safetensors file)."""
    return Path(run_dir) / EVAL_SNAPSHOTS / f"{CHECKPOINT_PREFIX}{step:06d}.safetensors"


def pending_eval_snapshots(run_dir: str | Path) -> dict[int, Path]:
    """Step -> file of every deferred evaluation written and not yet evaluated (a killed attempt leaves them).

    A file is renamed into place once complete, so every one listed is whole.
    """
    found = {}
    for path in (Path(run_dir) / EVAL_SNAPSHOTS).glob(f"{CHECKPOINT_PREFIX}*.safetensors"):
        stem = path.name.removeprefix(CHECKPOINT_PREFIX).removesuffix(".safetensors")
        if stem.isdigit():
            found[int(stem)] = path
    return found
