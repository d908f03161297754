"""The Delta tables on an object store: a real S3-compatible server (moto's server mode) on this machine.

delta-rs commits to S3 with conditional writes (``If-None-Match: *`` on the next log entry), so writers
need no lock service; the server must refuse a second create of one key, which moto does (checked here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import polars as pl
import pytest
from deltalake import DeltaTable

from reflow.storage.delta_store import DeltaTrajectoryStore

from .test_delta_store import make_trajectory, make_usage, race_writers_of_one_step

# One writer process: ``n`` batches of trajectories, each its own commit under app id ``writer-<k>``.
WRITER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("delta_store_tests", {helpers!r})
helpers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
make_trajectory = helpers.make_trajectory
from reflow.storage.delta_store import DeltaTrajectoryStore
root, k, n, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = DeltaTrajectoryStore(root)
for i in range(n):
    batch = [make_trajectory(per * i + j, run_id=f"w{{k}}", rollout_step=i) for j in range(per)]
    assert store.append_trajectories(batch, app_id=f"writer-{{k}}", txn_version=i) is not None
"""


def _root() -> str:
    return f"s3://reflow/{uuid.uuid4().hex[:12]}"


def test_the_server_refuses_a_second_create_of_one_key(s3_env: dict[str, str]) -> None:
    import boto3
    from botocore.exceptions import ClientError

    s3 = boto3.client("s3")
    key = f"{uuid.uuid4().hex}/_delta_log/00000000000000000000.json"
    s3.put_object(Bucket="reflow", Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        s3.put_object(Bucket="reflow", Key=key, Body=b"second", IfNoneMatch="*")
    assert s3.get_object(Bucket="reflow", Key=key)["Body"].read() == b"first"


def test_round_trip_and_query_on_the_object_store(s3_env: dict[str, str]) -> None:
    store = DeltaTrajectoryStore(_root())
    records = [make_trajectory(i) for i in range(4)]
    store.append_trajectories(records, app_id="rollout", txn_version=0)
    store.append_usage([make_usage(r.trajectory_id, 0) for r in records[:2]], app_id="usage", txn_version=0)
    assert store.read_trajectories(run_id="run-a").num_rows == 4
    used = store.query("SELECT count(DISTINCT trajectory_id) AS n FROM usage").column("n").to_pylist()
    assert used == [2]
    assert pl.read_delta(store.table_uri("trajectories")).height == 4  # another reader of the same table


def test_two_writers_appending_at_once_lose_no_commit(s3_env: dict[str, str]) -> None:
    root, n, per = _root(), 12, 3
    DeltaTrajectoryStore(root).append_trajectories([make_trajectory(0, run_id="w-init")], app_id="init", txn_version=0)
    script = WRITER.format(helpers=str(Path(__file__).with_name("test_delta_store.py")))
    writers = [subprocess.Popen([sys.executable, "-c", script, root, str(k), str(n), str(per)], env=os.environ,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outputs
    table = DeltaTable(f"{root}/trajectories")
    rows = table.to_pyarrow_table()
    assert rows.num_rows == 1 + 2 * n * per and len(set(rows["trajectory_id"].to_pylist())) == rows.num_rows
    history = table.history()
    appends = [h for h in history if h["operation"] == "WRITE"]
    assert len(appends) == 1 + 2 * n  # every commit is in the log, each once
    assert sorted(h["version"] for h in history) == list(range(table.version() + 1))  # no gap, no overwrite
    store = DeltaTrajectoryStore(root)
    assert [store.committed("trajectories", f"writer-{k}") for k in range(2)] == [n - 1, n - 1]


def test_concurrent_writers_of_one_step_write_it_once_on_the_object_store(s3_env: dict[str, str]) -> None:
    race_writers_of_one_step(_root(), writers=4)


def test_actors_get_the_drivers_object_store_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster an actor's node does not have the driver's environment: worker_env carries it."""
    from reflow.infra.placement import worker_env

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.example:9000")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    env = worker_env(2, eager=True)
    assert env["AWS_ENDPOINT_URL"] == "http://s3.example:9000" and env["AZURE_STORAGE_ACCOUNT_NAME"] == "acct"
    assert "UNRELATED_SECRET" not in env and env["OMP_NUM_THREADS"] == "2"


def test_an_unreachable_object_store_is_a_plain_error(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No server at the endpoint: a StorageError naming the table and the cause, without terminal colour codes."""
    from reflow.storage.store import StorageError

    from ..conftest import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError) as caught:
        DeltaTrajectoryStore(_root()).table_versions()
    message = str(caught.value)
    assert "cannot open Delta table s3://reflow/" in message and "Connection refused" in message
    assert "\x1b" not in message
