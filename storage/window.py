"""The selection window: the rows of one run a batch can come from, kept in memory and advanced by each commit.

A batch trained at version ``tv`` reads the trajectories of policy versions
``tv - S`` to ``tv`` and the usage rows of trainer versions ``tv - S`` and
later (their reuse counts; ``storage.replay``), ``S`` being
``buffer.max_staleness_versions``. However long a run is, that is about
``S + 1`` steps of rows. ``SelectionWindow`` keeps just those rows, and only
the columns the selection reads, as Arrow tables: read once from the Delta
tables (the trajectories' partitions outside the window pruned), then fed
by every commit the store makes in this process and cut as the floor
``tv - S`` rises. The selection's SQL runs on them in DataFusion, so its
cost follows the window, not the tables: not their rows, not their files,
not their log (docs/measurements.md, ``reflow bench-sampler``).

The window knows the table version it holds of each table. A commit it did
not see (another process's, or a retried append already committed before)
leaves the table at a version the window does not hold, and the next
selection reads the window afresh.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from datafusion import SessionConfig, SessionContext

from reflow.storage.schema import TRAJECTORY_SCHEMA, USAGE_SCHEMA
from reflow.storage.store import TRAJECTORIES, USAGE

# The columns a selection reads, and the one that says how old a row is.
WINDOW_SCHEMAS: dict[str, pa.Schema] = {
    TRAJECTORIES: pa.schema([TRAJECTORY_SCHEMA.field(c) for c in
                             ("run_id", "trajectory_id", "group_id", "sample_index", "policy_version", "reward")]),
    USAGE: pa.schema([USAGE_SCHEMA.field(c) for c in ("run_id", "trajectory_id", "trainer_version")]),
}
AGE_COLUMN = {TRAJECTORIES: "policy_version", USAGE: "trainer_version"}

# One partition per operator, not one per core (as for the Delta queries: docs/measurements.md).
SESSION = SessionConfig({"datafusion.execution.target_partitions": "1"})


def window_filter(name: str, run_id: str, floor: int) -> pc.Expression:
    """The rows of table ``name`` that belong to ``run_id``'s window at ``floor``."""
    return (pc.field("run_id") == run_id) & (pc.field(AGE_COLUMN[name]) >= floor)


class SelectionWindow:
    """``run_id``'s rows from version ``floor`` on, as of the table versions ``seen`` (module docstring).

    Not thread-safe: the store calls it under the lock that also covers its commits.
    """

    def __init__(self, run_id: str, floor: int, tables: Mapping[str, pa.Table], seen: Mapping[str, int]) -> None:
        self.run_id, self.floor = run_id, int(floor)
        self.seen = {name: int(seen[name]) for name in WINDOW_SCHEMAS}
        self._parts: dict[str, list[pa.Table]] = {name: [] for name in WINDOW_SCHEMAS}
        for name, table in tables.items():
            self._keep(name, table)

    def holds(self, versions: Mapping[str, int], floor: int) -> bool:
        """Whether the window is ``run_id``'s rows at ``floor`` as of the table versions ``versions``."""
        return floor >= self.floor and all(self.seen[name] == versions[name] for name in WINDOW_SCHEMAS)

    def add(self, name: str, data: pa.Table, version: int) -> None:
        """Commit ``version`` of table ``name`` appended ``data``: keep its rows of the window.

        A version that does not follow the one held means a commit was
        missed; the window then holds no version and is read again.
        """
        if name not in WINDOW_SCHEMAS:
            return
        if self.seen[name] != version - 1:
            self.seen[name] = -2  # no table is at version -2: ``holds`` is false until read again
            return
        self._keep(name, data)
        self.seen[name] = version

    def advance(self, floor: int) -> None:
        """Drop the rows older than ``floor`` (a floor below the window's is the caller's to refuse)."""
        if floor <= self.floor:
            return
        self.floor = int(floor)
        for name, parts in self._parts.items():
            kept = []
            for part in parts:
                ages = part.column(AGE_COLUMN[name])
                if pc.min(ages).as_py() >= floor:
                    kept.append(part)
                elif pc.max(ages).as_py() >= floor:
                    kept.append(part.filter(pc.greater_equal(ages, floor)))
            self._parts[name] = kept

    def tables(self) -> dict[str, pa.Table]:
        """The window's rows of each table (immutable: a selection may read them while commits go on)."""
        return {name: pa.concat_tables(parts) if parts else WINDOW_SCHEMAS[name].empty_table()
                for name, parts in self._parts.items()}

    def _keep(self, name: str, data: pa.Table) -> None:
        rows = data.select(WINDOW_SCHEMAS[name].names).filter(window_filter(name, self.run_id, self.floor))
        if rows.num_rows:
            self._parts[name].append(rows.cast(WINDOW_SCHEMAS[name]))


def run_sql(tables: Mapping[str, pa.Table], sql: str) -> pa.Table:
    """DataFusion ``sql`` over in-memory ``tables`` (registered by name), with plain string types."""
    ctx = SessionContext(SESSION)
    for name, table in tables.items():
        ctx.from_arrow(table, name)  # registers it as ``name`` (an empty table too, unlike record batches)
    return plain_types(ctx.sql(sql).to_arrow_table())


def plain_types(table: pa.Table) -> pa.Table:
    """``table`` without view types: DataFusion returns ``string_view``/``binary_view`` columns, which many
    consumers (pandas, older polars) handle poorly; they are cast back."""
    target = pa.schema([f.with_type(plain_type(f.type)) for f in table.schema])
    return table if target.equals(table.schema) else table.cast(target)


def plain_type(arrow_type: pa.DataType) -> pa.DataType:
    """``arrow_type`` with view types replaced by their plain equivalents (recursively in lists)."""
    if arrow_type == pa.string_view():
        return pa.string()
    if arrow_type == pa.binary_view():
        return pa.binary()
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_list_view(arrow_type):
        return pa.list_(arrow_type.value_field.with_type(plain_type(arrow_type.value_type)))
    return arrow_type
