"""``RecentTrajectories``: the trainer's reads by id equal the store's, reading only files it has not read."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from reflow.storage import recent as recent_module
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.recent import RecentTrajectories
from tests.storage.test_delta_store import make_trajectory


def _append(store: DeltaTrajectoryStore, step: int, version: int, count: int = 6) -> list[str]:
    rows = [make_trajectory(i, rollout_step=step, policy_version=version) for i in range(count)]
    store.append_trajectories(rows, app_id="run-a:trajectories", txn_version=step)
    return [r.trajectory_id for r in rows]


def test_reads_equal_the_stores_and_only_new_files_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    reads: list[str] = []
    real = pq.read_table
    monkeypatch.setattr(recent_module.pq, "read_table", lambda path, *a, **k: reads.append(str(path)) or real(path))
    recent = RecentTrajectories(store)
    ids = {}
    for step in range(6):  # one commit (one file) per step, version = step // 2
        ids[step] = _append(store, step, version=step // 2)
        if step < 2:
            continue
        wanted = ids[step] + ids[step - 1][:3] + ids[step - 2][1:2]
        versions = ((step - 2) // 2, step // 2)
        before = len(reads)
        got = recent.read("run-a", wanted, versions)
        assert got.equals(store.read_trajectories(run_id="run-a", ids=wanted, versions=versions))
        assert got.num_rows == len(wanted)
        assert len(reads) - before == (3 if step == 2 else 1), "a file already read was read again"
    assert {v for v, _ in recent.parts.values()} == {1, 2}  # version 0 dropped: below the lowest asked for


def test_older_rows_and_rewritten_files_fall_back_to_the_store(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    first = _append(store, 0, version=0)
    second = _append(store, 1, version=3)
    recent = RecentTrajectories(store)
    assert recent.read("run-a", second, (3, 3)).num_rows == 6
    # version 0 was dropped from what is kept; asking for it again reads the table
    got = recent.read("run-a", first[:2] + second[:2], (0, 3))
    assert sorted(got.column("trajectory_id").to_pylist()) == sorted(first[:2] + second[:2])
    _append(store, 2, version=3)
    store.compact(retention_hours=0)  # files rewritten and vacuumed: what was kept is cleared, then read anew
    third = _append(store, 3, version=4)
    got = recent.read("run-a", second + third, (3, 4))
    assert got.equals(store.read_trajectories(run_id="run-a", ids=second + third, versions=(3, 4)))
    # other runs' rows in the same files are never returned
    assert recent.read("run-b", second, (3, 4)).num_rows == 0


def test_rows_from_keep_from_on_are_kept_for_later_reads_that_reach_further_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's oldest row may be older than the previous batch's (replay): it is kept, not read from the table."""
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    ids = {version: _append(store, version, version=version) for version in range(5)}
    recent = RecentTrajectories(store)
    fallbacks: list[tuple[int, int]] = []
    real = store.read_trajectories
    monkeypatch.setattr(store, "read_trajectories",
                        lambda **k: fallbacks.append(k["versions"]) or real(**k))
    assert recent.read("run-a", ids[3] + ids[4], (3, 4), keep_from=1).num_rows == 12
    assert {v for v, _ in recent.parts.values()} == {1, 2, 3, 4}  # version 0 dropped: below keep_from
    got = recent.read("run-a", ids[1][:2] + ids[4][:2], (1, 4), keep_from=2)
    assert got.equals(real(run_id="run-a", ids=ids[1][:2] + ids[4][:2], versions=(1, 4)))
    assert fallbacks == []
    assert {v for v, _ in recent.parts.values()} == {1, 2, 3, 4}  # never above the lowest this read asked for
    assert recent.read("run-a", ids[4], (4, 4), keep_from=2).num_rows == 6
    assert {v for v, _ in recent.parts.values()} == {2, 3, 4}
    recent.read("run-a", ids[1][:1], (1, 1), keep_from=2)  # below keep_from: was dropped, so the table answers
    assert fallbacks == [(1, 1)]


def test_kept_fresh_new_files_are_read_before_the_next_read(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``keep_fresh`` a committed file is read in the background; the next read reads nothing."""
    import time

    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    reads: list[str] = []
    real = pq.read_table
    monkeypatch.setattr(recent_module.pq, "read_table", lambda path, *a, **k: reads.append(str(path)) or real(path))
    recent = RecentTrajectories(store)
    first = _append(store, 0, version=1)
    assert recent.read("run-a", first, (1, 1)).num_rows == 6 and len(reads) == 1
    recent.keep_fresh(interval_s=0.01)
    try:
        _append(store, 1, version=0)  # below the lowest version asked for: never read
        second = _append(store, 2, version=2)
        deadline = time.monotonic() + 10
        while len(reads) < 2:
            assert time.monotonic() < deadline, "the background reader did not read the new file"
            time.sleep(0.01)
        got = recent.read("run-a", first + second, (1, 2))
        assert len(reads) == 2, "the read read a file again"
        assert got.equals(store.read_trajectories(run_id="run-a", ids=first + second, versions=(1, 2)))
    finally:
        recent.close()
