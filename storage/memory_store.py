"""An in-process ``TrajectoryStore`` for unit tests of other code (the selection's SQL only; use Delta on ``tmp_path``
for the rest)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import pyarrow as pa

from reflow.storage.schema import (
    TRAJECTORY_SCHEMA,
    USAGE_SCHEMA,
)
from reflow.storage.store import (
    READ_ORDER,
    TABLE_SPECS,
    TRAJECTORIES,
    USAGE,
    RecordAppends,
    trajectory_filter,
)
from reflow.storage.window import WINDOW_SCHEMAS, run_sql, window_filter


class InMemoryTrajectoryStore(RecordAppends):
    """``TrajectoryStore`` on in-process Arrow tables, for unit tests of other code.

    Same idempotency and version numbering as the Delta store (creating a
    table is version 0, its first append version 1). ``select`` runs the
    selection's SQL on the window's rows; ``query`` is not supported: use a
    ``DeltaTrajectoryStore`` on ``tmp_path`` for the other SQL.
    """

    def __init__(self, root: str = "memory://") -> None:
        """An empty store; ``root`` is only a label."""
        self.root = root
        self._tables: dict[str, pa.Table] = {}
        self._versions: dict[str, int] = {}
        self._txns: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def _append(self, name: str, data: pa.Table, app_id: str, txn_version: int) -> int | None:
        """Append ``data`` to ``name`` unless ``(app_id, txn_version)`` was already committed."""
        if data.num_rows == 0:
            return None
        with self._lock:
            done = self._txns.get((name, app_id))
            if done is not None and done >= txn_version:
                return None
            current = self._tables.get(name, TABLE_SPECS[name].schema.empty_table())
            self._tables[name] = pa.concat_tables([current, data])
            self._versions[name] = self._versions.get(name, 0) + 1
            self._txns[(name, app_id)] = txn_version
            return self._versions[name]

    def committed(self, name: str, app_id: str) -> int | None:
        """The latest ``txn_version`` committed to table ``name`` under ``app_id`` (None: none yet)."""
        with self._lock:
            return self._txns.get((name, app_id))

    def read_trajectories(self, *, run_id: str, rollout_step: int | None = None,
                          ids: Sequence[str] | None = None, versions: tuple[int, int] | None = None) -> pa.Table:
        """Trajectories of ``run_id``, filtered and ordered as in the Delta store."""
        with self._lock:
            table = self._tables.get(TRAJECTORIES, TRAJECTORY_SCHEMA.empty_table())
        return table.filter(trajectory_filter(run_id, rollout_step, ids, versions)).sort_by(READ_ORDER)

    def usage(self) -> pa.Table:
        """All usage rows (what tests use instead of SQL)."""
        with self._lock:
            return self._tables.get(USAGE, USAGE_SCHEMA.empty_table())

    def query(self, sql: str, as_of: Mapping[str, int] | None = None) -> pa.Table:
        """Not supported in memory; raises NotImplementedError."""
        raise NotImplementedError("InMemoryTrajectoryStore does not run SQL (deltalake's DataFusion only reads "
                                  "Delta tables); use DeltaTrajectoryStore(tmp_path) in tests that query")

    def select(self, run_id: str, floor: int, sql: str) -> pa.Table:
        """A selection's SQL over the window's rows (``storage.window``), read from the tables each time."""
        with self._lock:
            tables = {name: self._tables.get(name, TABLE_SPECS[name].schema.empty_table()) for name in WINDOW_SCHEMAS}
        return run_sql({name: table.select(WINDOW_SCHEMAS[name].names).filter(window_filter(name, run_id, floor))
                        for name, table in tables.items()}, sql)

    def table_versions(self) -> dict[str, int]:
        """Current version of each table; -1 for a table not created yet."""
        with self._lock:
            return {name: self._versions.get(name, -1) for name in TABLE_SPECS}

    def compact(self, retention_hours: int | None = None) -> dict[str, object]:
        """Merge each table's chunks; versions are unchanged. Returns an empty metrics dict per table."""
        with self._lock:
            self._tables = {name: table.combine_chunks() for name, table in self._tables.items()}
            return {name: {} for name in self._tables}
