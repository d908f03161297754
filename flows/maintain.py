"""The maintenance flow: compact, checkpoint and vacuum a run's Delta tables while no run writes them.

Deployable on a schedule like any Prefect flow; ``reflow maintain`` runs it
once. It checks the writer locks itself (not only the command line), so a
scheduled run never vacuums under a live run.
"""

from __future__ import annotations

from prefect import flow

from reflow.tasks.maintenance import check_writers, compact_tables


@flow(name="maintain", log_prints=False)
def maintain(store_root: str, run_dir: str | None = None, retention_hours: int | None = None,
             force: bool = False) -> dict[str, object]:
    """Compact small files, write a checkpoint, vacuum files older than ``retention_hours`` (None: 7 days)."""
    check_writers(run_dir, store_root, force)
    return compact_tables(store_root, retention_hours)
