"""MLflowTracker (sqlite store in tmp_path) and NullTracker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from reflow.storage.tracker import MLflowTracker, NullTracker, Tracker, make_tracker


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_mlflow_run_round_trip(tracking_uri: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    tracker = MLflowTracker(tracking_uri, "reflow-test")
    assert isinstance(tracker, Tracker)
    params = {f"param_{i:03d}": str(i) for i in range(150)}  # more than one log_batch allows
    params["long"] = "x" * 7000  # over MLflow's 6000-character limit
    run_id = tracker.start("run-1", params=params, tags={"mode": "sync"})
    assert tracker.run_id == run_id
    tracker.log_metrics({"loss": 1.5, "reward": 0.25, "bad": math.nan, "worse": math.inf}, step=0)
    tracker.log_metrics({"loss": 1.0}, step=1)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "weights.bin").write_bytes(b"\0" * 8)
    tracker.log_artifact(tmp_path / "config.json")
    tracker.log_artifact(tmp_path / "ckpt", artifact_path="checkpoints")
    tracker.log_text("hello", "notes/readme.txt")
    tracker.end()
    tracker.end()  # a second end is harmless

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-1"
    assert len(run.data.params) == 151
    assert run.data.params["param_149"] == "149"
    assert len(run.data.params["long"]) == 6000
    assert run.data.tags["mode"] == "sync"
    assert set(run.data.metrics) == {"loss", "reward"}
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.5), (1, 1.0)]
    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"config.json", "checkpoints", "notes"}
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == ["checkpoints/weights.bin"]
    # Artifacts live next to the database, not under the working directory.
    assert run.info.artifact_uri.startswith(Path(tracking_uri[len("sqlite:///"):]).parent.as_uri())
    assert run_id in tracker.ui_url() and tracking_uri in tracker.ui_url()



def test_connect_in_another_thread_opens_the_store_and_makes_no_run(tmp_path: Path) -> None:
    """A run's start-up connects while its workers start: the database and experiment exist, no run yet; start
    then opens the run there."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "reflow-connect")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(tracker.connect).result()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("reflow-connect")
    assert experiment is not None and tracker.experiment_id == experiment.experiment_id
    assert client.search_runs([experiment.experiment_id]) == []
    run_id = tracker.start("run-1", params={}, tags={})
    tracker.connect()  # connected already: nothing more
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    tracker.end()
    NullTracker().connect()  # the protocol's no-op

def test_failed_status_and_errors(tracking_uri: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    tracker = MLflowTracker(tracking_uri, "reflow-test")
    with pytest.raises(RuntimeError, match="start"):
        tracker.log_metrics({"loss": 1.0}, step=0)
    run_id = tracker.start("run-2", params={}, tags={})
    with pytest.raises(FileNotFoundError, match="missing"):
        tracker.log_artifact(tmp_path / "missing")
    tracker.end("FAILED")
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "FAILED"


def test_file_store_is_refused_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ValueError, match="sqlite"):
        MLflowTracker(str(tmp_path / "mlruns"), "x")
    with pytest.raises(ValueError, match="sqlite"):
        MLflowTracker(f"file://{tmp_path}/mlruns", "x")


def test_null_tracker_does_nothing(tmp_path: Path) -> None:
    tracker = NullTracker()
    assert isinstance(tracker, Tracker)
    run_id = tracker.start("run", params={"a": "1"}, tags={})
    assert tracker.run_id == run_id and len(run_id) == 32
    tracker.log_metrics({"loss": math.nan}, step=0)
    tracker.log_artifact(tmp_path / "missing")
    tracker.log_text("x", "y.txt")
    tracker.end("KILLED")
    assert tracker.ui_url() == "tracking disabled"
    assert list(tmp_path.iterdir()) == []


def test_make_tracker(tmp_path: Path) -> None:
    assert isinstance(make_tracker("none", "e", tmp_path), NullTracker)
    assert isinstance(make_tracker("", "e", tmp_path), NullTracker)
    default = make_tracker(None, "e", tmp_path / "runs")
    assert isinstance(default, MLflowTracker)
    assert default.tracking_uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    remote = make_tracker("http://mlflow.example:5000", "e", tmp_path)
    assert isinstance(remote, MLflowTracker) and remote.tracking_uri == "http://mlflow.example:5000"
