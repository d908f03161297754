"""The trajectory store's interface: its tables, their specs, the ``TrajectoryStore`` protocol and its error.

Two implementations: ``storage.delta_store`` (Delta Lake, local disk or
object storage; the real one) and ``storage.memory_store`` (in-process, for
unit tests of other code). Every SQL string lives in ``storage``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.compute as pc

from reflow.storage.schema import (
    CACHE_SCHEMA,
    TRAJECTORY_SCHEMA,
    USAGE_SCHEMA,
    CachedSample,
    Trajectory,
    Usage,
    to_table,
)

TRAJECTORIES = "trajectories"
USAGE = "usage"
ROLLOUT_CACHE = "rollout_cache"


class StorageError(RuntimeError):
    """A table cannot be opened, written or queried; the message names the path and the cause.

    delta-rs colours the cause chain of object-store errors with terminal escape codes; they are dropped,
    so the message reads the same in a terminal, a log file and the Prefect UI.
    """

    def __init__(self, message: str) -> None:
        super().__init__(re.sub(r"\x1b\[[0-9;]*m", "", message))


@dataclass(frozen=True)
class TableSpec:
    """What a table under the root must look like."""

    name: str
    schema: pa.Schema
    partition_by: tuple[str, ...]


TABLE_SPECS: dict[str, TableSpec] = {
    TRAJECTORIES: TableSpec(TRAJECTORIES, TRAJECTORY_SCHEMA, ("policy_version",)),
    USAGE: TableSpec(USAGE, USAGE_SCHEMA, ()),
    ROLLOUT_CACHE: TableSpec(ROLLOUT_CACHE, CACHE_SCHEMA, ()),
}


# Rows come back in a fixed order so that seeded sampling over a read is
# reproducible whatever the file layout (compaction reorders files).
READ_ORDER = [("rollout_step", "ascending"), ("trajectory_id", "ascending")]


@runtime_checkable
class TrajectoryStore(Protocol):
    """Append-only store of trajectories and of their usage (the consumption log)."""

    root: str

    def append_trajectories(self, records: Sequence[Trajectory], *, app_id: str, txn_version: int) -> int | None:
        """Append records; return the new table version, or None if skipped (already written or empty)."""
        ...

    def append_usage(self, rows: Sequence[Usage], *, app_id: str, txn_version: int) -> int | None:
        """Append usage rows; return the new table version, or None if skipped."""
        ...

    def append_cache(self, rows: Sequence[CachedSample], *, app_id: str, txn_version: int) -> int | None:
        """Append a rollout-cache snapshot; return the new table version, or None if skipped."""
        ...

    def committed(self, name: str, app_id: str) -> int | None:
        """The latest ``txn_version`` committed to table ``name`` under ``app_id`` (None: none yet)."""
        ...

    def read_trajectories(self, *, run_id: str, rollout_step: int | None = None,
                          ids: Sequence[str] | None = None, versions: tuple[int, int] | None = None) -> pa.Table:
        """Trajectories of one run (optionally one rollout step, some ids, a version range), in TRAJECTORY_SCHEMA."""
        ...

    def query(self, sql: str, as_of: Mapping[str, int] | None = None) -> pa.Table:
        """Run SQL over the tables (``trajectories``, ``usage``, ``rollout_cache``), optionally at given versions."""
        ...

    def select(self, run_id: str, floor: int, sql: str) -> pa.Table:
        """Run a selection's SQL over ``run_id``'s rows from version ``floor`` on (``storage.window``)."""
        ...

    def table_versions(self) -> dict[str, int]:
        """Current version of each table; -1 for a table not created yet."""
        ...

    def compact(self, retention_hours: int | None = None) -> dict[str, object]:
        """Merge small files, checkpoint and vacuum each table; return metrics per table."""
        ...


class RecordAppends(ABC):
    """The three typed appends of a ``TrajectoryStore``, over the implementation's one ``_append``.

    ``_append(table name, Arrow rows, app_id, txn_version)`` returns the new
    table version, or None when ``(app_id, txn_version)`` was already committed
    or there are no rows.
    """

    @abstractmethod
    def _append(self, name: str, data: pa.Table, app_id: str, txn_version: int) -> int | None:
        """Commit ``data`` to table ``name`` under ``(app_id, txn_version)``, each store its own way."""

    def append_arrow(self, name: str, data: pa.Table, *, app_id: str, txn_version: int) -> int | None:
        """Append Arrow rows in table ``name``'s schema (bulk loads: ``reflow bench-sampler``); as the typed ones."""
        if not data.schema.equals(TABLE_SPECS[name].schema):
            raise StorageError(f"rows for {name!r} are not in its schema:\n{data.schema}")
        return self._append(name, data, app_id, txn_version)

    def append_trajectories(self, records: Sequence[Trajectory], *, app_id: str, txn_version: int) -> int | None:
        """Append trajectories; return the new table version, or None if skipped (already written or empty)."""
        return self._append(TRAJECTORIES, to_table(records, TRAJECTORY_SCHEMA), app_id, txn_version)

    def append_usage(self, rows: Sequence[Usage], *, app_id: str, txn_version: int) -> int | None:
        """Append usage rows; return the new table version, or None if skipped (already written or empty)."""
        return self._append(USAGE, to_table(rows, USAGE_SCHEMA), app_id, txn_version)

    def append_cache(self, rows: Sequence[CachedSample], *, app_id: str, txn_version: int) -> int | None:
        """Append a rollout-cache snapshot; return the new table version, or None if skipped."""
        return self._append(ROLLOUT_CACHE, to_table(rows, CACHE_SCHEMA), app_id, txn_version)


def trajectory_filter(run_id: str, rollout_step: int | None, ids: Sequence[str] | None,
                      versions: tuple[int, int] | None = None) -> pc.Expression:
    """The row filter of ``read_trajectories`` as a pyarrow expression.

    ``versions`` (lowest, highest policy version) prunes partitions, so a
    read touches only the files of the versions it needs.
    """
    expr = pc.field("run_id") == run_id
    if versions is not None:
        expr &= (pc.field("policy_version") >= versions[0]) & (pc.field("policy_version") <= versions[1])
    if rollout_step is not None:
        expr &= pc.field("rollout_step") == rollout_step
    if ids is not None:
        expr &= pc.field("trajectory_id").isin(list(ids))
    return expr


def quote(text: str) -> str:
    """``text`` as an SQL string literal (every query that embeds a run id uses this)."""
    return "'" + text.replace("'", "''") + "'"
