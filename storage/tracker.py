"""Experiment tracking: one MLflow run per training run, or nothing at all.

``MLflowTracker`` talks to MLflow only through ``MlflowClient`` with explicit
run ids (no global active run), so it is safe to call from several threads.
``mlflow`` is imported on ``start()``: importing it takes about a second and
opening a fresh sqlite store another one to four, which command-line entry
points should not pay. ``NullTracker`` has the same methods and does nothing,
so the training loop never asks whether tracking is on.

MLflow 3.x refuses the plain file store (``file:`` or a bare path) unless
``MLFLOW_ALLOW_FILE_STORE=true``; the local default is a sqlite database.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlparse

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]

# MLflow's limits (mlflow.utils.validation) on one log_batch call and on values.
MAX_PARAMS_OR_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_CHARS = 6000
MAX_TAG_VALUE_CHARS = 8000
_TRUNCATION_MARK = "...[truncated]"

# Tracking URIs that make make_tracker return a NullTracker.
DISABLED_URIS = ("", "none", "null", "off", "disabled")

T = TypeVar("T")


@runtime_checkable
class Tracker(Protocol):
    """Records one training run: parameters, metrics per step, artifacts."""

    run_id: str | None

    def connect(self) -> None:
        """Open the store ahead of ``start`` (which opens it if nobody did); may run in another thread."""
        ...

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        """Open the run, log its parameters and tags; return the run id."""
        ...

    def resume(self, run_id: str) -> None:
        """Reopen the existing run ``run_id`` (a resumed training run logs into the same run)."""
        ...

    def logged_steps(self) -> dict[str, set[int]]:
        """Per metric key, the steps already logged in the open run."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log scalar metrics at ``step``; non-finite values are dropped."""
        ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or a directory (under ``artifact_path`` in the run)."""
        ...

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file``."""
        ...

    def end(self, status: RunStatus = "FINISHED") -> None:
        """Close the run with ``status``."""
        ...

    def ui_url(self) -> str:
        """Where a person looks at the run."""
        ...


class NullTracker:
    """A tracker that records nothing; ``start`` still returns a fresh unique run id."""

    def __init__(self) -> None:
        """No run yet."""
        self.run_id: str | None = None

    def connect(self) -> None:
        """Nothing to open."""

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        """Return a new random run id (32 hex digits, like MLflow's)."""
        self.run_id = uuid.uuid4().hex
        return self.run_id

    def resume(self, run_id: str) -> None:
        """Remember ``run_id``."""
        self.run_id = run_id

    def logged_steps(self) -> dict[str, set[int]]:
        """Nothing was logged."""
        return {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Do nothing."""

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Do nothing."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Do nothing."""

    def end(self, status: RunStatus = "FINISHED") -> None:
        """Do nothing."""

    def ui_url(self) -> str:
        """There is nothing to open."""
        return "tracking disabled"


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of ``items`` of at most ``size`` entries."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _truncate(value: object, limit: int, what: str) -> str:
    """``str(value)`` cut to ``limit`` characters (MLflow rejects longer values), with a warning."""
    text = str(value)
    if len(text) <= limit:
        return text
    logger.warning("%s is %d characters; MLflow keeps at most %d, truncating", what, len(text), limit)
    return text[:limit - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK


def _is_file_store(tracking_uri: str) -> bool:
    """Whether MLflow would treat ``tracking_uri`` as its (deprecated) file store."""
    scheme = urlparse(tracking_uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a one-letter scheme is a Windows drive


def quiet_mlflow_logging() -> None:
    """Silence MLflow's INFO lines about creating and migrating the sqlite database, and the SQLAlchemy 2.1
    deprecation its sqlite store trips once per process (MLflow 3.17's; not ours to fix)."""
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*``noload`` loader strategy is deprecated")


def _sqlite_artifact_root(tracking_uri: str) -> str | None:
    """Artifact root next to a sqlite database; None for other stores (the server decides).

    Without it MLflow puts artifacts in ``./mlruns`` under the current working
    directory, which differs between processes and pollutes the repository.
    """
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    db_path = Path(tracking_uri[len(prefix):])
    return (db_path.parent / "mlartifacts").absolute().as_uri()


class MLflowTracker:
    """``Tracker`` writing one MLflow run per training run.

    A single process should own the run: a sqlite store tolerates several
    threads but not many concurrent writer processes ("database is locked").
    """

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        """Remember where to track; nothing is opened until ``start``."""
        if _is_file_store(tracking_uri) and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise ValueError(f"tracking URI {tracking_uri!r} is an MLflow file store, which MLflow 3 refuses; "
                             "use 'sqlite:///<absolute path>/mlflow.db' or an http(s):// tracking server")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client: MlflowClient | None = None
        self._ended = False

    def connect(self) -> None:
        """Open the store and find or create the experiment: a new sqlite database is created and migrated here
        (about 3 s). ``start`` calls it if nobody did; a run's start-up calls it in a thread while its workers
        start."""
        if self._client is not None:
            return
        from mlflow import MlflowClient

        quiet_mlflow_logging()
        client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment_id(client)
        self._client = client

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        """Create the experiment if needed, open a run, log ``params`` and ``tags``; return the run id."""
        from mlflow.entities import Param, RunTag

        self.connect()
        run = self._client.create_run(self.experiment_id, run_name=run_name)
        self.run_id = run.info.run_id
        self._ended = False
        param_list = [Param(k, _truncate(v, MAX_PARAM_VALUE_CHARS, f"param {k}")) for k, v in params.items()]
        tag_list = [RunTag(k, _truncate(v, MAX_TAG_VALUE_CHARS, f"tag {k}")) for k, v in tags.items()]
        for param_batch in _chunks(param_list, MAX_PARAMS_OR_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=param_batch)
        for tag_batch in _chunks(tag_list, MAX_PARAMS_OR_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=tag_batch)
        return self.run_id

    def resume(self, run_id: str) -> None:
        """Reopen run ``run_id`` (left RUNNING or FAILED by a killed attempt) and mark it RUNNING again."""
        from mlflow import MlflowClient

        quiet_mlflow_logging()
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        run = self._client.get_run(run_id)
        self.run_id, self.experiment_id, self._ended = run_id, run.info.experiment_id, False
        self._client.update_run(run_id, status="RUNNING")

    def logged_steps(self) -> dict[str, set[int]]:
        """Per metric key, the steps already logged (so a resumed run logs each step once)."""
        client, run_id = self._active()
        keys = client.get_run(run_id).data.metrics
        return {key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys}

    def _experiment_id(self, client: MlflowClient) -> str:
        """Id of ``self.experiment``, created (with artifacts next to a sqlite db) if missing."""
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                return client.create_experiment(self.experiment,
                                                artifact_location=_sqlite_artifact_root(self.tracking_uri))
            except MlflowException:
                found = client.get_experiment_by_name(self.experiment)  # created concurrently
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise ValueError(f"MLflow experiment {self.experiment!r} at {self.tracking_uri} is deleted; "
                             f"restore it (mlflow experiments restore --experiment-id {found.experiment_id}) "
                             "or choose another experiment name")
        return found.experiment_id

    def _active(self) -> tuple[MlflowClient, str]:
        """Client and run id of the open run; raise if ``start`` was not called."""
        if self._client is None or self.run_id is None:
            raise RuntimeError("MLflowTracker: call start() before logging")
        return self._client, self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log the finite values of ``metrics`` at ``step`` (NaN and infinities are dropped)."""
        from mlflow.entities import Metric

        client, run_id = self._active()
        timestamp_ms = int(time.time() * 1000)
        finite = [(k, float(v)) for k, v in metrics.items() if math.isfinite(float(v))]
        entries = [Metric(k, v, timestamp_ms, step) for k, v in finite]
        for batch in _chunks(entries, MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        client, run_id = self._active()
        path = Path(path)
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path)
        elif path.is_file():
            client.log_artifact(run_id, str(path), artifact_path)
        else:
            raise FileNotFoundError(f"cannot log artifact {path}: no such file or directory")

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file`` (e.g. ``config/resolved.json``)."""
        client, run_id = self._active()
        client.log_text(run_id, text, artifact_file)

    def end(self, status: RunStatus = "FINISHED") -> None:
        """Close the run with ``status``; a second call, or one before ``start``, does nothing."""
        if self._client is None or self.run_id is None or self._ended:
            return
        self._client.set_terminated(self.run_id, status)
        self._ended = True

    def ui_url(self) -> str:
        """The run's page on a tracking server, or how to open a local store in ``mlflow ui``."""
        if self.run_id is None:
            return self.tracking_uri
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if urlparse(self.tracking_uri).scheme in ("http", "https"):
            return f"{self.tracking_uri.rstrip('/')}/{page}"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}  then open  http://127.0.0.1:5000/{page}"


def make_tracker(tracking_uri: str | None, experiment: str, default_dir: Path) -> Tracker:
    """The tracker a run configuration asks for.

    ``tracking_uri`` None means the local default, a sqlite store at
    ``<default_dir>/mlflow.db`` (artifacts in ``<default_dir>/mlartifacts``);
    one of ``DISABLED_URIS`` ("none", "off", ...) turns tracking off; anything
    else is passed to MLflow (``sqlite:///...``, ``http://host:5000``, ...).
    """
    if tracking_uri is None:
        default_dir = Path(default_dir).absolute()
        default_dir.mkdir(parents=True, exist_ok=True)
        return MLflowTracker(f"sqlite:///{default_dir / 'mlflow.db'}", experiment)
    if tracking_uri.strip().lower() in DISABLED_URIS:
        return NullTracker()
    return MLflowTracker(tracking_uri, experiment)
