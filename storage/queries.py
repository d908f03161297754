"""The run's bookkeeping queries: what the usage log records, what a stream wrote, what the rollout cache holds.

Batch selection itself is ``storage.replay`` (the ReFlow buffer) and
``storage.sampler`` (a sync round); these are the queries a resumed run, the
trainer's recovery and ``run.max_new_groups`` ask.
"""

from __future__ import annotations

from reflow.storage.replay import Kind, ReplaySelection
from reflow.storage.schema import CachedSample
from reflow.storage.store import ROLLOUT_CACHE, TRAJECTORIES, USAGE, TrajectoryStore, quote


def recorded_batch_sql(run_id: str, trainer_step: int) -> str:
    """SQL of the batch that ``usage`` records for ``trainer_step`` of ``run_id``."""
    return ("SELECT trajectory_id, loss_weight, trainer_version, staleness FROM usage "
            f"WHERE run_id = {quote(run_id)} AND trainer_step = {int(trainer_step)} ORDER BY trajectory_id")


def recorded_batch(store: TrajectoryStore, run_id: str, trainer_step: int) -> dict[str, float]:
    """``{trajectory_id: loss_weight}`` of the batch trained at ``trainer_step``, rebuilt from ``usage``."""
    cols = store.query(recorded_batch_sql(run_id, trainer_step)).to_pydict()
    return dict(zip(cols["trajectory_id"], (float(w) for w in cols["loss_weight"])))


def trained_groups(store: TrajectoryStore, run_id: str, before_step: int) -> int:
    """Distinct groups that ``usage`` records as trained on by steps before ``before_step`` (0 without a log).

    A resumed run counts its spent ``run.max_new_groups`` budget with it.
    """
    if before_step <= 0 or store.table_versions().get(USAGE, -1) < 0:
        return 0
    rows = store.query(
        f"SELECT COUNT(DISTINCT t.group_id) AS n FROM {USAGE} u JOIN {TRAJECTORIES} t "
        f"ON u.trajectory_id = t.trajectory_id WHERE u.run_id = {quote(run_id)} "
        f"AND u.trainer_step < {int(before_step)}").to_pylist()
    return int(rows[0]["n"]) if rows else 0


def recorded_selection(store: TrajectoryStore, run_id: str, trainer_step: int) -> ReplaySelection | None:
    """The whole selection ``usage`` records for ``trainer_step`` (a resumed run trains it again), or None.

    Loss weights and the trainer version are the logged ones; reuse counts
    are the uses logged by earlier steps, and a row's kind follows from them
    (``replay`` if used before, else ``fresh`` at the logged trainer version,
    else ``stale``), as ``select_batch`` labelled it. None without a log.
    """
    if store.table_versions().get(USAGE, -1) < 0:
        return None
    run = quote(run_id)
    rows = store.query(
        f"WITH prior AS (SELECT trajectory_id, COUNT(*) AS reuse FROM {USAGE} WHERE run_id = {run} "
        f"AND trainer_step < {int(trainer_step)} GROUP BY trajectory_id) "
        f"SELECT u.trajectory_id, u.loss_weight, u.trainer_version, t.policy_version, t.group_id, "
        f"COALESCE(prior.reuse, 0) AS reuse FROM {USAGE} u JOIN {TRAJECTORIES} t "
        f"ON u.trajectory_id = t.trajectory_id LEFT JOIN prior ON prior.trajectory_id = u.trajectory_id "
        f"WHERE u.run_id = {run} AND u.trainer_step = {int(trainer_step)} ORDER BY u.trajectory_id").to_pylist()
    if not rows:
        return None
    version = int(rows[0]["trainer_version"])
    kinds: list[Kind] = ["replay" if r["reuse"] else ("fresh" if r["policy_version"] == version else "stale")
                         for r in rows]
    return ReplaySelection(trajectory_ids=[r["trajectory_id"] for r in rows],
                           loss_weights=[float(r["loss_weight"]) for r in rows],
                           policy_versions=[int(r["policy_version"]) for r in rows],
                           group_ids=[r["group_id"] for r in rows], reuse_counts=[int(r["reuse"]) for r in rows],
                           kinds=kinds, trainer_version=version)



def recorded_batches_after(store: TrajectoryStore, run_id: str, after_step: int) -> list[dict[str, float]]:
    """``{trajectory_id: loss_weight}`` of every step after ``after_step`` the usage log records, in step order.

    A restarted trainer replays them on its newest checkpoint. Empty without a log.
    """
    if store.table_versions().get(USAGE, -1) < 0:
        return []
    rows = store.query(f"SELECT trainer_step, trajectory_id, loss_weight FROM {USAGE} WHERE run_id = "
                       f"{quote(run_id)} AND trainer_step > {int(after_step)} "
                       "ORDER BY trainer_step, trajectory_id").to_pylist()
    batches: dict[int, dict[str, float]] = {}
    for r in rows:
        batches.setdefault(int(r["trainer_step"]), {})[r["trajectory_id"]] = float(r["loss_weight"])
    return [batches[step] for step in sorted(batches)]


def written_groups(store: TrajectoryStore, run_id: str) -> dict[str, int]:
    """Every group of ``run_id`` in ``trajectories``: group id -> its oldest policy version."""
    if store.table_versions().get(TRAJECTORIES, -1) < 0:
        return {}
    rows = store.query(f"SELECT group_id, MIN(policy_version) AS version FROM {TRAJECTORIES} "
                       f"WHERE run_id = {quote(run_id)} GROUP BY group_id").to_pylist()
    return {r["group_id"]: int(r["version"]) for r in rows}


def trained_group_ids(store: TrajectoryStore, run_id: str) -> set[str]:
    """The groups of ``run_id`` the usage log records as trained on at least once."""
    if store.table_versions().get(USAGE, -1) < 0:
        return set()
    rows = store.query(f"SELECT DISTINCT t.group_id FROM {USAGE} u JOIN {TRAJECTORIES} t "
                       f"ON u.trajectory_id = t.trajectory_id WHERE u.run_id = {quote(run_id)}").to_pylist()
    return {r["group_id"] for r in rows}


def groups_written_after(store: TrajectoryStore, run_id: str, rollout_step: int) -> set[str]:
    """The groups of ``run_id`` in ``trajectories`` written by rounds after ``rollout_step``."""
    if store.table_versions().get(TRAJECTORIES, -1) < 0:
        return set()
    rows = store.query(f"SELECT DISTINCT group_id FROM {TRAJECTORIES} WHERE run_id = {quote(run_id)} "
                       f"AND rollout_step > {int(rollout_step)}").to_pylist()
    return {r["group_id"] for r in rows}


def latest_cache_snapshot(store: TrajectoryStore, run_id: str) -> list[CachedSample]:
    """The rows of the newest rollout-cache snapshot of ``run_id`` (empty: none written)."""
    if store.table_versions().get(ROLLOUT_CACHE, -1) < 0:
        return []
    run = quote(run_id)
    rows = store.query(f"SELECT * FROM {ROLLOUT_CACHE} WHERE run_id = {run} AND round = "
                       f"(SELECT MAX(round) FROM {ROLLOUT_CACHE} WHERE run_id = {run})").to_pylist()
    return [CachedSample(**row) for row in rows]
