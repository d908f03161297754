"""DeltaTrajectoryStore and InMemoryTrajectoryStore against tmp_path."""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.memory_store import InMemoryTrajectoryStore
from reflow.storage.schema import TRAJECTORY_SCHEMA, Trajectory, Usage, trajectories_from_table
from reflow.storage.store import StorageError, TrajectoryStore

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def make_trajectory(index: int, *, run_id: str = "run-a", rollout_step: int = 0, policy_version: int = 0) -> Trajectory:
    """A small valid trajectory whose last token came from the next policy version."""
    n = 3 + index % 3
    return Trajectory(
        trajectory_id=f"{run_id}-s{rollout_step}-t{index}", run_id=run_id, prompt_id=f"p{index // 2}",
        group_id=f"g{rollout_step}-{index // 2}", sample_index=index % 2, env="arithmetic",
        rollout_step=rollout_step, policy_version=policy_version,
        prompt_tokens=[1, 2, index], response_tokens=list(range(n)),
        behaviour_logprobs=[-0.5] * n, token_versions=[policy_version] * (n - 1) + [policy_version + 1],
        loss_mask=[1] * (n - 1) + [0], reward=float(index % 2), correct=bool(index % 2),
        finish_reason="stop", response_length=n, created_at=T0 + dt.timedelta(seconds=index))


def make_usage(trajectory_id: str, trainer_step: int) -> Usage:
    """One use of ``trajectory_id`` at ``trainer_step``."""
    return Usage(run_id="run-a", trajectory_id=trajectory_id, trainer_step=trainer_step,
                 trainer_version=trainer_step, loss_weight=1.0, staleness=trainer_step, created_at=T0)


@pytest.fixture
def store(tmp_path: Path) -> DeltaTrajectoryStore:
    return DeltaTrajectoryStore(str(tmp_path / "store"))


def test_round_trip_equals_input(store: DeltaTrajectoryStore) -> None:
    records = [make_trajectory(i, policy_version=i % 2) for i in range(6)]
    assert isinstance(store, TrajectoryStore)
    assert store.table_versions() == {"trajectories": -1, "usage": -1, "rollout_cache": -1}
    version = store.append_trajectories(records, app_id="rollout", txn_version=0)
    assert version == 1  # version 0 is the empty table's creation
    table = store.read_trajectories(run_id="run-a")
    assert table.schema.names == TRAJECTORY_SCHEMA.names
    back = sorted(trajectories_from_table(table), key=lambda t: t.trajectory_id)
    assert back == sorted(records, key=lambda t: t.trajectory_id)


def test_read_filters_by_step_and_ids(store: DeltaTrajectoryStore) -> None:
    for step in range(3):
        batch = [make_trajectory(i, rollout_step=step, policy_version=step) for i in range(4)]
        store.append_trajectories(batch, app_id="rollout", txn_version=step)
    store.append_trajectories([make_trajectory(0, run_id="run-b")], app_id="rollout-b", txn_version=0)
    assert store.read_trajectories(run_id="run-a").num_rows == 12
    step1 = store.read_trajectories(run_id="run-a", rollout_step=1)
    assert set(step1.column("rollout_step").to_pylist()) == {1}
    assert step1.num_rows == 4
    ids = ["run-a-s2-t3", "run-a-s0-t1", "missing"]
    picked = store.read_trajectories(run_id="run-a", ids=ids)
    assert picked.column("trajectory_id").to_pylist() == ["run-a-s0-t1", "run-a-s2-t3"]  # read order
    assert store.read_trajectories(run_id="run-a", rollout_step=0, ids=ids).num_rows == 1
    assert store.read_trajectories(run_id="nobody").num_rows == 0


def test_groups_written_after_a_round(store: DeltaTrajectoryStore) -> None:
    from reflow.storage.queries import groups_written_after

    assert groups_written_after(store, "run-a", -1) == set()  # no table yet
    for step in range(3):
        store.append_trajectories([make_trajectory(i, rollout_step=step) for i in range(4)], app_id="rollout",
                                  txn_version=step)
    store.append_trajectories([make_trajectory(0, run_id="run-b", rollout_step=5)], app_id="rollout-b", txn_version=0)
    assert groups_written_after(store, "run-a", 0) == {"g1-0", "g1-1", "g2-0", "g2-1"}
    assert groups_written_after(store, "run-a", 2) == set()
    assert groups_written_after(store, "run-b", -1) == {"g5-0"}


def test_partitioned_by_policy_version(store: DeltaTrajectoryStore) -> None:
    records = [make_trajectory(i, policy_version=v) for i, v in enumerate([0, 0, 3, 7])]
    store.append_trajectories(records, app_id="rollout", txn_version=0)
    table = DeltaTable(f"{store.root}/trajectories")
    assert table.metadata().partition_columns == ["policy_version"]
    dirs = sorted(p.name for p in Path(store.root, "trajectories").iterdir() if p.name != "_delta_log")
    assert dirs == ["policy_version=0", "policy_version=3", "policy_version=7"]


def test_retried_write_is_skipped(store: DeltaTrajectoryStore) -> None:
    records = [make_trajectory(i) for i in range(4)]
    first = store.append_trajectories(records, app_id="rollout", txn_version=5)
    retry = store.append_trajectories(records, app_id="rollout", txn_version=5)
    older = store.append_trajectories(records, app_id="rollout", txn_version=4)
    assert first == 1 and retry is None and older is None
    assert store.read_trajectories(run_id="run-a").num_rows == 4
    # Another application id is independent; a newer step of the same one is written.
    assert store.append_trajectories(records, app_id="other", txn_version=5) == 2
    assert store.append_trajectories(records, app_id="rollout", txn_version=6) == 3
    assert store.read_trajectories(run_id="run-a").num_rows == 12
    assert store.table_versions() == {"trajectories": 3, "usage": -1, "rollout_cache": -1}


def test_empty_append_writes_nothing(store: DeltaTrajectoryStore) -> None:
    assert store.append_trajectories([], app_id="rollout", txn_version=0) is None
    assert store.table_versions()["trajectories"] == -1


def test_usage_and_reuse_count_query(store: DeltaTrajectoryStore) -> None:
    records = [make_trajectory(i) for i in range(3)]
    store.append_trajectories(records, app_id="rollout", txn_version=0)
    ids = [r.trajectory_id for r in records]
    store.append_usage([make_usage(ids[0], 0), make_usage(ids[1], 0)], app_id="trainer", txn_version=0)
    store.append_usage([make_usage(ids[0], 1)], app_id="trainer", txn_version=1)
    assert store.append_usage([make_usage(ids[0], 1)], app_id="trainer", txn_version=1) is None
    reuse = store.query("""
        SELECT t.trajectory_id, COUNT(u.trajectory_id) AS uses
        FROM trajectories t LEFT JOIN usage u ON t.trajectory_id = u.trajectory_id
        GROUP BY t.trajectory_id ORDER BY t.trajectory_id""")
    assert {row["trajectory_id"]: row["uses"] for row in reuse.to_pylist()} == {ids[0]: 2, ids[1]: 1, ids[2]: 0}
    assert reuse.schema.field("trajectory_id").type == pa.string()  # not DataFusion's string_view


def test_query_errors_are_storage_errors(store: DeltaTrajectoryStore) -> None:
    with pytest.raises(StorageError, match="no rows have been written"):
        store.query("SELECT COUNT(*) FROM usage")
    store.append_trajectories([make_trajectory(0)], app_id="rollout", txn_version=0)
    with pytest.raises(StorageError, match="no rows have been written"):
        store.query("SELECT COUNT(*) FROM usage")
    with pytest.raises(StorageError, match="no_such_column"):
        store.query("SELECT no_such_column FROM trajectories")


def test_readable_by_pyarrow_and_polars(store: DeltaTrajectoryStore) -> None:
    records = [make_trajectory(i, policy_version=i % 2) for i in range(4)]
    store.append_trajectories(records, app_id="rollout", txn_version=0)
    uri = f"{store.root}/trajectories"
    dataset = DeltaTable(uri).to_pyarrow_dataset()
    assert dataset.count_rows() == 4
    pl = pytest.importorskip("polars")
    frame = pl.read_delta(uri)
    assert frame.height == 4
    assert sorted(frame["trajectory_id"].to_list()) == sorted(r.trajectory_id for r in records)
    lazy = pl.scan_delta(uri).filter(pl.col("policy_version") == 1).collect()
    assert lazy.height == 2


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("hello")
    with pytest.raises(StorageError, match="is an existing file"):
        DeltaTrajectoryStore(str(root))


def test_directory_that_is_not_delta_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "store" / "trajectories"
    foreign.mkdir(parents=True)
    (foreign / "data.parquet").write_bytes(b"not really parquet")
    with pytest.raises(StorageError, match=r"trajectories.*not a Delta table"):
        DeltaTrajectoryStore(str(tmp_path / "store"))
    assert os.listdir(foreign) == ["data.parquet"]


def test_empty_table_directory_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "store" / "usage").mkdir(parents=True)
    store = DeltaTrajectoryStore(str(tmp_path / "store"))
    assert store.append_usage([make_usage("x", 0)], app_id="trainer", txn_version=0) == 1


def test_table_with_other_schema_is_refused_and_unchanged(tmp_path: Path) -> None:
    uri = str(tmp_path / "store" / "trajectories")
    write_deltalake(uri, pa.table({"id": [1, 2], "payload": ["a", "b"]}))
    with pytest.raises(StorageError, match=r"trajectories.*missing column 'trajectory_id'"):
        DeltaTrajectoryStore(str(tmp_path / "store"))
    assert DeltaTable(uri).version() == 0
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 2


def test_unreadable_table_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table_dir = tmp_path / "store" / "trajectories"
    table_dir.mkdir(parents=True)
    table_dir.chmod(0)
    try:
        if os.access(table_dir, os.R_OK):  # root reads anything: answer as the owner would, from the mode bits
            real_access = os.access

            def owner_access(path, mode, **kwargs):
                if Path(path) == table_dir:
                    return stat.S_IMODE(os.stat(path).st_mode) & 0o500 == 0o500
                return real_access(path, mode, **kwargs)

            monkeypatch.setattr(os, "access", owner_access)
        with pytest.raises(StorageError, match="trajectories exists but is not readable"):
            DeltaTrajectoryStore(str(tmp_path / "store"))
    finally:
        table_dir.chmod(0o755)


def test_relative_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert DeltaTrajectoryStore("rel").root == str(tmp_path / "rel")


def test_compact_after_many_small_appends(store: DeltaTrajectoryStore) -> None:
    for step in range(12):
        batch = [make_trajectory(i, rollout_step=step, policy_version=step % 2) for i in range(2)]
        store.append_trajectories(batch, app_id="rollout", txn_version=step)
        store.append_usage([make_usage(batch[0].trajectory_id, step)], app_id="trainer", txn_version=step)
    before = store.read_trajectories(run_id="run-a")
    metrics = store.compact()
    assert metrics["trajectories"]["files_removed"] == 12  # one file per append
    assert metrics["trajectories"]["files_added"] == 2  # one per policy_version partition
    assert metrics["usage"]["files_added"] == 1
    assert store.read_trajectories(run_id="run-a").equals(before)
    assert store.query("SELECT COUNT(*) AS n FROM usage").column("n").to_pylist() == [12]
    # Idempotency survives compaction and checkpointing.
    assert store.append_trajectories([make_trajectory(0)], app_id="rollout", txn_version=11) is None


def test_in_memory_store_has_the_same_behaviour() -> None:
    store = InMemoryTrajectoryStore()
    assert isinstance(store, TrajectoryStore)
    records = [make_trajectory(i, rollout_step=i % 2) for i in range(4)]
    assert store.append_trajectories(records, app_id="rollout", txn_version=0) == 1
    assert store.append_trajectories(records, app_id="rollout", txn_version=0) is None
    assert store.append_usage([make_usage(records[0].trajectory_id, 0)], app_id="trainer", txn_version=0) == 1
    assert store.table_versions() == {"trajectories": 1, "usage": 1, "rollout_cache": -1}
    table = store.read_trajectories(run_id="run-a", rollout_step=1)
    assert trajectories_from_table(table) == [records[1], records[3]]
    assert store.read_trajectories(run_id="run-a", ids=[records[2].trajectory_id]).num_rows == 1
    assert store.usage().num_rows == 1
    with pytest.raises(NotImplementedError, match="DeltaTrajectoryStore"):
        store.query("SELECT 1")


def race_writers_of_one_step(root: str, writers: int) -> None:
    """``writers`` threads, each with its own store (as separate workers would), write one step: it lands once."""
    records = [make_trajectory(i) for i in range(3)]
    results: list[int | None] = []
    errors: list[Exception] = []

    def write() -> None:
        try:
            results.append(DeltaTrajectoryStore(root).append_trajectories(records, app_id="rollout", txn_version=0))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(r is not None for r in results) == 1
    assert DeltaTrajectoryStore(root).read_trajectories(run_id="run-a").num_rows == 3


def test_concurrent_writers_of_one_step_write_it_once(tmp_path: Path) -> None:
    race_writers_of_one_step(str(tmp_path / "store"), writers=6)
