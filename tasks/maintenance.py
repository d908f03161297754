"""Table maintenance tasks: check that nobody writes, then compact, checkpoint and vacuum."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.runlock import LiveWriterError, describe_writers, live_writers
from reflow.storage.delta_store import DeltaTrajectoryStore


@task(name="check_writers", cache_policy=NO_CACHE)
def check_writers(run_dir: str | None, store_root: str, force: bool) -> int:
    """Raise LiveWriterError if a live run holds a writer lock on these tables (unless ``force``).

    Returns the number of live writers ignored because of ``force``.
    """
    writers = live_writers(run_dir, store_root)
    if writers and not force:
        raise LiveWriterError("a run is writing to these tables; maintenance would vacuum files it may still "
                              "need. Wait for it to finish (or pass --force if the lock is wrong):\n"
                              + describe_writers(writers))
    return len(writers)


@task(name="compact_tables", cache_policy=NO_CACHE)
def compact_tables(store_root: str, retention_hours: int | None) -> dict[str, object]:
    """Compact, checkpoint and vacuum every reflow table under ``store_root``; metrics per table."""
    return DeltaTrajectoryStore(store_root).compact(retention_hours=retention_hours)
