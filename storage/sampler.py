"""Batch selection as SQL over the trajectories table.

Every mode's batch is a query; the sync mode's is the simplest: all
trajectories generated for one rollout step, whole GRPO groups by
construction, weight 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from reflow.storage.schema import Usage
from reflow.storage.store import TrajectoryStore, quote


@dataclass(frozen=True)
class BatchSelection:
    """Which trajectories one trainer step uses, and with what weights (aligned lists)."""

    trajectory_ids: list[str]
    loss_weights: list[float]
    policy_versions: list[int]

    def usage_rows(self, run_id: str, trainer_step: int, trainer_version: int) -> list[Usage]:
        """The ``usage`` rows that record this batch as trained at ``trainer_step`` by weights ``trainer_version``."""
        return [Usage(run_id=run_id, trajectory_id=tid, trainer_step=trainer_step, trainer_version=trainer_version,
                      loss_weight=w, staleness=trainer_version - v)
                for tid, w, v in zip(self.trajectory_ids, self.loss_weights, self.policy_versions)]


def sync_batch_sql(run_id: str, rollout_step: int) -> str:
    """SQL of the sync mode's batch: the whole rollout of ``rollout_step``."""
    return (
        "SELECT trajectory_id, policy_version FROM trajectories "
        f"WHERE run_id = {quote(run_id)} AND rollout_step = {int(rollout_step)} "
        "ORDER BY group_id, sample_index"
    )


def sync_batch(store: TrajectoryStore, run_id: str, rollout_step: int) -> BatchSelection:
    """The sync mode's batch for ``rollout_step`` (raises if the step wrote nothing)."""
    rows = store.query(sync_batch_sql(run_id, rollout_step)).to_pydict()
    if not rows.get("trajectory_id"):
        raise RuntimeError(f"no trajectories for run {run_id!r} rollout step {rollout_step}")
    ids = rows["trajectory_id"]
    return BatchSelection(trajectory_ids=list(ids), loss_weights=[1.0] * len(ids),
                          policy_versions=[int(v) for v in rows["policy_version"]])
