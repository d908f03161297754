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

The window relies on the run's writer lock (``infra.runlock``): while a run
is live, one process appends its rows, through one store, so every commit
after the window was read passes through ``add``. Other runs' rows in the
same tables never enter it, and their commits cost it nothing. A new
process (a resume) reads the window afresh, and so does a selection below
the window's floor.
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

# One partition per operator, not one per core: selection p95 at 1M rows 95 -> 80 ms (docs/measurements.md).
# The Delta queries (``DeltaTrajectoryStore.query``) use the same options.
SESSION_OPTIONS = {"datafusion.execution.target_partitions": "1"}
# The selection's plan is planned anew for every batch, and planning is over half its time on a 20,000-row
# window: one pass of the logical optimiser instead of three saves about 1 ms of 14 (docs/measurements.md).
WINDOW_OPTIONS = {**SESSION_OPTIONS, "datafusion.optimizer.max_passes": "1"}


def window_filter(name: str, run_id: str, floor: int) -> pc.Expression:
    """The rows of table ``name`` that belong to ``run_id``'s window at ``floor``."""
    return (pc.field("run_id") == run_id) & (pc.field(AGE_COLUMN[name]) >= floor)


class SelectionWindow:
    """``run_id``'s rows from version ``floor`` on (module docstring).

    A commit's rows are kept as they come (``add``: filtering each one cost
    more than a small commit's worth of rows) and folded into one part of
    the window when a selection reads them (``tables``): one filter and one
    concatenation per selection, whatever the number of commits between two
    selections. A part goes when the floor passes its newest row and is cut
    when the floor falls inside it. A driver at 128 GPUs appends about 200
    times a step, and a window of a part per commit cost 49 ms a selection
    to cut (docs/measurements.md).

    Not thread-safe: the store calls it under the lock that also covers its commits.
    """

    def __init__(self, run_id: str, floor: int, tables: Mapping[str, pa.Table]) -> None:
        self.run_id, self.floor = run_id, int(floor)
        # the window's rows: (oldest, newest version, rows) per part, and the commits not folded in yet
        self._parts: dict[str, list[tuple[int, int, pa.Table]]] = {name: [] for name in WINDOW_SCHEMAS}
        self._new: dict[str, list[pa.Table]] = {name: [] for name in WINDOW_SCHEMAS}
        for name, table in tables.items():
            self.add(name, table)

    def add(self, name: str, data: pa.Table) -> None:
        """Table ``name`` got ``data`` (a commit, or what was read): its rows of the window are kept (filtered
        when next read)."""
        schema = WINDOW_SCHEMAS.get(name)
        if schema is None or not data.num_rows:
            return
        rows = data.select(schema.names)
        self._new[name].append(rows if rows.schema.equals(schema) else rows.cast(schema))

    def advance(self, floor: int) -> None:
        """Drop the rows older than ``floor`` (a floor below the window's is the caller's to refuse)."""
        if floor <= self.floor:
            return
        self.floor = int(floor)
        for name, parts in self._parts.items():
            kept = []
            for oldest, newest, part in parts:
                if oldest >= floor:
                    kept.append((oldest, newest, part))
                elif newest >= floor:
                    ages = part.column(AGE_COLUMN[name])
                    part = part.filter(pc.greater_equal(ages, floor))
                    kept.append((pc.min(part.column(AGE_COLUMN[name])).as_py(), newest, part))
            self._parts[name] = kept

    def tables(self) -> dict[str, pa.Table]:
        """The window's rows of each table (immutable: a selection may read them while commits go on)."""
        out = {}
        for name, new in self._new.items():
            if new:
                rows = pa.concat_tables(new).combine_chunks()
                # a mask, not ``window_filter``'s expression: Acero's filter plan cost 6x as much on a step's rows
                ages = rows.column(AGE_COLUMN[name])
                rows = rows.filter(pc.and_(pc.equal(rows.column("run_id"), self.run_id),
                                           pc.greater_equal(ages, self.floor)))
                if rows.num_rows:
                    bounds = pc.min_max(rows.column(AGE_COLUMN[name])).as_py()
                    self._parts[name].append((bounds["min"], bounds["max"], rows))
                self._new[name] = []
            parts = [part for _, _, part in self._parts[name]]
            out[name] = pa.concat_tables(parts) if parts else WINDOW_SCHEMAS[name].empty_table()
        return out


def run_sql(tables: Mapping[str, pa.Table], sql: str) -> pa.Table:
    """DataFusion ``sql`` over in-memory ``tables`` (registered by name), with plain string types."""
    ctx = SessionContext(SessionConfig(WINDOW_OPTIONS))
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
