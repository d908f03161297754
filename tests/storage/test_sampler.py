from __future__ import annotations

from pathlib import Path

import pytest

from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.sampler import sync_batch
from reflow.storage.schema import Trajectory
from reflow.storage.store import StorageError


def _traj(run: str, step: int, prompt: int, k: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{run}/{step}/p{prompt}/{k}", run_id=run, prompt_id=f"p{prompt}",
                      group_id=f"{run}/{step}/p{prompt}", sample_index=k, env="arith", rollout_step=step,
                      policy_version=step, prompt_tokens=[5, 6], response_tokens=[7, 2],
                      behaviour_logprobs=[-1.0, -2.0],
                      token_versions=[step, step], loss_mask=[1, 1], reward=float(k % 2), correct=bool(k % 2),
                      finish_reason="stop", response_length=2)


def test_sync_batch_selects_exactly_one_step_of_one_run(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    for step in range(3):
        store.append_trajectories([_traj("a", step, p, k) for p in range(3) for k in range(4)],
                                  app_id="a:t", txn_version=step)
    store.append_trajectories([_traj("b'x", 1, 0, 0)], app_id="b:t", txn_version=1)
    batch = sync_batch(store, "a", 1)
    assert len(batch.trajectory_ids) == 12
    assert all(t.startswith("a/1/") for t in batch.trajectory_ids)
    assert batch.loss_weights == [1.0] * 12 and batch.policy_versions == [1] * 12
    assert sync_batch(store, "b'x", 1).trajectory_ids == ["b'x/1/p0/0"]  # quoting is safe
    with pytest.raises(RuntimeError, match="no trajectories"):
        sync_batch(store, "a", 9)


def test_sync_batch_before_any_write_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        sync_batch(DeltaTrajectoryStore(tmp_path), "a", 0)
