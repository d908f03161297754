"""``DeltaTrajectoryStore``: the trajectory store on Delta tables under one root.

Layout under ``root`` (a local path or an ``s3://``, ``gs://``, ``az://`` URI)::

    <root>/trajectories    partitioned by policy_version, schema TRAJECTORY_SCHEMA
    <root>/usage           unpartitioned, schema USAGE_SCHEMA
    <root>/rollout_cache   unpartitioned, schema CACHE_SCHEMA

Tables are created lazily on the first append. Every append carries a Delta
application transaction ``(app_id, txn_version)``; an append whose
``txn_version`` is not newer than the one already committed for ``app_id`` is
skipped, so a retried step never duplicates rows.

Open tables are kept, one set per thread: opening a table replays its log
(30 ms on a fresh run, more as a streaming run's commits pile up), while a
kept one reads only the commits since it was last used
(``update_incremental``, about 1 ms). A ``DeltaTable`` is not safe to refresh
while another thread reads it, so each thread keeps its own; a store object
may therefore be shared by every thread of a process, and processes share
nothing but the files.

The batch selection (``select``) runs on a selection window per run
(``storage.window``): the rows it can read, fed by this store's commits
under one lock, so a selection never sees a commit without its rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from reflow.storage.schema import (
    TRAJECTORY_SCHEMA,
)
from reflow.storage.store import (
    READ_ORDER,
    TABLE_SPECS,
    TRAJECTORIES,
    RecordAppends,
    StorageError,
    TableSpec,
    trajectory_filter,
)
from reflow.storage.window import (
    SESSION_OPTIONS,
    WINDOW_SCHEMAS,
    SelectionWindow,
    plain_types,
    run_sql,
    window_filter,
)

# Appends retried after losing a commit race (delta-rs already retries plain
# append-vs-append conflicts internally; these are txn and metadata conflicts).
COMMIT_ATTEMPTS = 5


def _local_path(uri: str) -> Path | None:
    """The local filesystem path of ``uri``, or None for an object-store URI."""
    if "://" not in uri:
        return Path(uri)
    parsed = urlparse(uri)
    return Path(parsed.path) if parsed.scheme == "file" else None


def _schema_differences(found: DeltaSchema, expected: pa.Schema) -> list[str]:
    """Human-readable differences between a table's schema and the expected one."""
    want = {f.name: f for f in DeltaSchema.from_arrow(expected).fields}
    have = {f.name: f for f in found.fields}
    diffs = [f"missing column {name!r}" for name in want if name not in have]
    diffs += [f"unexpected column {name!r}" for name in have if name not in want]
    for name in want.keys() & have.keys():
        if (want[name].type, want[name].nullable) != (have[name].type, have[name].nullable):
            diffs.append(f"column {name!r} is {have[name].type} (nullable={have[name].nullable}), "
                         f"expected {want[name].type} (nullable={want[name].nullable})")
    if not diffs and [f.name for f in found.fields] != list(want):
        diffs.append("columns are in a different order")
    return diffs


def _plain_arrow(reader: object) -> pa.Table:
    """A DataFusion result (an Arrow stream) as a pyarrow table without view types (``window.plain_types``)."""
    return plain_types(pa.RecordBatchReader.from_stream(reader).read_all())


class DeltaTrajectoryStore(RecordAppends):
    """``TrajectoryStore`` on Delta tables (local disk or object storage); thread-safe (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, str] | None = None) -> None:
        """Check ``root`` and any tables already under it; raise StorageError if unusable.

        A local root is made absolute, so that processes with another working
        directory (Ray workers) find the same tables. Nothing is written here.
        """
        root = os.fspath(root)
        self.root = str(Path(root).absolute()) if "://" not in root else root.rstrip("/")
        self.storage_options = storage_options
        local = _local_path(self.root)
        if local is not None and local.exists() and not local.is_dir():
            raise StorageError(f"trajectory store root {self.root} is an existing file, not a directory")
        self._threads = threading.local()  # per thread: {table name: DeltaTable kept open}
        # Selection windows by run id (storage.window), and the lock that makes a commit and the windows' view
        # of it one step: a selection never sees a table version without its rows or the other way round.
        self._windows: dict[str, SelectionWindow] = {}
        self._commits = threading.Lock()
        for name in TABLE_SPECS:
            self._open(name)

    def table_uri(self, name: str) -> str:
        """URI (or absolute path) of table ``name`` under the root."""
        return f"{self.root}/{name}"

    def _open(self, name: str, version: int | None = None) -> DeltaTable | None:
        """The validated table ``name`` (at ``version``, default the latest), or None if it does not exist yet."""
        uri = self.table_uri(name)
        local = _local_path(uri)
        if local is not None and not self._local_table_exists(local):
            return None
        try:
            table = DeltaTable(uri, storage_options=self.storage_options)
            if version is not None:
                latest = table.version()
                if not 0 <= version <= latest:
                    raise StorageError(f"table {name!r} under {self.root} has versions 0..{latest}; "
                                       f"version {version} does not exist")
                table = DeltaTable(uri, version=version, storage_options=self.storage_options)
        except TableNotFoundError as exc:
            if local is None:  # object stores have no directories: absent means not created
                return None
            raise StorageError(f"{uri} is not a Delta table: {exc}") from exc
        except (DeltaError, OSError) as exc:
            at = "" if version is None else f" at version {version} (its files were vacuumed?)"
            raise StorageError(f"cannot open Delta table {uri}{at}: {exc}") from exc
        self._validate(table, TABLE_SPECS[name], uri)
        return table

    @staticmethod
    def _local_table_exists(path: Path) -> bool:
        """Whether a local table directory exists; raise StorageError if it exists but is unusable.

        An empty directory counts as absent (safe to create a table in). A
        non-empty one without ``_delta_log`` is refused: a later vacuum would
        delete every file Delta does not know about.
        """
        if not path.exists():
            return False
        if not path.is_dir():
            raise StorageError(f"{path} exists but is a file, not a Delta table directory")
        if not os.access(path, os.R_OK | os.X_OK):
            raise StorageError(f"{path} exists but is not readable (check its permissions)")
        try:
            entries = os.listdir(path)
        except OSError as exc:
            raise StorageError(f"{path} exists but cannot be listed: {exc}") from exc
        if entries and "_delta_log" not in entries:
            raise StorageError(f"{path} exists and holds files but is not a Delta table (no _delta_log); "
                               "refusing to write into it: choose another store root")
        return bool(entries)

    @staticmethod
    def _validate(table: DeltaTable, spec: TableSpec, uri: str) -> None:
        """Raise StorageError if ``table`` is not a ``spec`` table (e.g. another project's table)."""
        diffs = _schema_differences(table.schema(), spec.schema)
        partitions = tuple(table.metadata().partition_columns)
        if partitions != spec.partition_by:
            diffs.append(f"partitioned by {list(partitions)}, expected {list(spec.partition_by)}")
        if diffs:
            raise StorageError(f"Delta table {uri} does not have the reflow {spec.name} schema "
                               f"(it was left unchanged): " + "; ".join(diffs))

    def latest_table(self, name: str) -> DeltaTable | None:
        """Table ``name`` as this thread keeps it open, brought up to its latest version (None: not created yet).

        The caller may read it in this thread; it is not to be handed to another one.
        """
        kept: dict[str, DeltaTable] = self._threads.__dict__.setdefault("tables", {})
        table = kept.get(name)
        if table is None:
            table = self._open(name)
            if table is not None:
                kept[name] = table
            return table
        try:
            table.update_incremental()
        except DeltaError:  # replaced under us (a table deleted and created again): open it afresh
            del kept[name]
            return self.latest_table(name)
        return table

    def _open_or_create(self, name: str) -> DeltaTable:
        """Table ``name``, created empty with its schema if absent."""
        table = self._open(name)
        if table is not None:
            return table
        spec = TABLE_SPECS[name]
        uri = self.table_uri(name)
        try:
            return DeltaTable.create(uri, spec.schema, mode="error", partition_by=list(spec.partition_by) or None,
                                     name=spec.name, storage_options=self.storage_options)
        except DeltaError as exc:
            # Another writer created it between our check and create. (Two racing
            # creates can also both succeed, as versions 0 and 1 with the same
            # metadata; an append racing the second is retried by _append.)
            table = self._open(name)
            if table is None:
                raise StorageError(f"cannot create Delta table {uri}: {exc}") from exc
            return table

    def _append(self, name: str, data: pa.Table, app_id: str, txn_version: int) -> int | None:
        """Append ``data`` to ``name`` under transaction ``(app_id, txn_version)`` unless already done."""
        if data.num_rows == 0:
            return None
        if name not in WINDOW_SCHEMAS:
            return self._commit(name, data, app_id, txn_version)
        with self._commits:
            return self._commit(name, data, app_id, txn_version)

    def _commit(self, name: str, data: pa.Table, app_id: str, txn_version: int) -> int | None:
        props = CommitProperties(app_transactions=[Transaction(app_id, txn_version)])
        failure: CommitFailedError | None = None
        for _ in range(COMMIT_ATTEMPTS):
            table = self.latest_table(name) or self._open_or_create(name)  # kept tables read only new commits
            if _already_committed(table, app_id, txn_version):
                return None
            try:
                # The DeltaTable carries storage_options; write_deltalake ignores new ones.
                write_deltalake(table, data, mode="append", commit_properties=props)
                for window in self._windows.values():
                    window.add(name, data)
                return table.version()
            except CommitFailedError as exc:
                # A concurrent commit won: one with the same app id (then the
                # re-check above skips) or a racing table creation; look again.
                failure = exc
            except DeltaError as exc:
                raise StorageError(f"append to {self.table_uri(name)} failed: {exc}") from exc
        raise StorageError(f"append to {self.table_uri(name)} failed after {COMMIT_ATTEMPTS} "
                           f"attempts against concurrent writers: {failure}") from failure

    def committed(self, name: str, app_id: str) -> int | None:
        """The latest ``txn_version`` committed to table ``name`` under ``app_id`` (None: none yet).

        A resumed run asks this to find the work a killed attempt already wrote.
        """
        table = self.latest_table(name)
        return None if table is None else table.transaction_version(app_id)

    def read_trajectories(self, *, run_id: str, rollout_step: int | None = None,
                          ids: Sequence[str] | None = None, versions: tuple[int, int] | None = None) -> pa.Table:
        """Trajectories of ``run_id`` (optionally of one rollout step, some ids, a policy-version range).

        Returns a table in TRAJECTORY_SCHEMA, ordered by (rollout_step,
        trajectory_id); empty if nothing was written yet. Filters are pushed
        into the scan: partitions outside ``versions`` and files whose
        statistics exclude the run are skipped. The table stays open between
        reads (only new commits are read the next time).
        """
        table = self.latest_table(TRAJECTORIES)
        if table is None:
            return TRAJECTORY_SCHEMA.empty_table()
        try:
            rows = table.to_pyarrow_dataset().to_table(filter=trajectory_filter(run_id, rollout_step, ids, versions))
        except (DeltaError, OSError, pa.ArrowException) as exc:
            raise StorageError(f"reading {self.table_uri(TRAJECTORIES)} failed: {exc}") from exc
        return rows.select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA).sort_by(READ_ORDER)

    def query(self, sql: str, as_of: Mapping[str, int] | None = None) -> pa.Table:
        """Run DataFusion SQL over the tables (registered by name); raise StorageError with the SQL engine's message.

        ``as_of`` maps table names to the Delta version to read (time
        travel); tables not named are read at their latest version.
        """
        as_of = dict(as_of or {})
        unknown = sorted(set(as_of) - set(TABLE_SPECS))
        if unknown:
            raise StorageError(f"no table named {', '.join(map(repr, unknown))}; tables: {', '.join(TABLE_SPECS)}")
        builder = QueryBuilder(SESSION_OPTIONS)
        missing = []
        for name in TABLE_SPECS:
            table = self._open(name, as_of[name]) if name in as_of else self.latest_table(name)
            if table is None:
                if name in as_of:
                    raise StorageError(f"table {name!r} does not exist yet under {self.root}")
                missing.append(name)
            else:
                builder.register(name, table)
        try:
            return _plain_arrow(builder.execute(sql))
        except (DeltaError, pa.ArrowException) as exc:
            message = str(exc)
            for name in missing:
                if f"table 'datafusion.public.{name}' not found" in message:
                    raise StorageError(f"table {name!r} does not exist yet under {self.root}: "
                                       "no rows have been written to it") from exc
            hint = ""
            if as_of and "not found" in message:
                hint = ("\n(a time-travel read needs the files of that version; "
                        "`reflow maintain` may have vacuumed them)")
            raise StorageError(f"query on {self.root} failed: {message}\nSQL: {sql}{hint}") from exc

    def select(self, run_id: str, floor: int, sql: str) -> pa.Table:
        """A selection's SQL over ``run_id``'s window from version ``floor`` on (``storage.window``): tables
        ``trajectories`` and ``usage`` holding only those rows and the columns in ``window.WINDOW_SCHEMAS``.

        The window is read from the tables on the first selection of ``run_id`` and for a floor below the
        window's; otherwise it is what this store's commits fed it (the run's writer lock makes this store
        the run's only writer). Raise StorageError if the tables cannot be read.
        """
        with self._commits:
            window = self._windows.get(run_id)
            if window is None or floor < window.floor:
                window = self._windows[run_id] = SelectionWindow(run_id, floor, self._window_rows(run_id, floor))
            else:
                window.advance(floor)
            tables = window.tables()
        try:
            return run_sql(tables, sql)
        except Exception as exc:  # DataFusion raises plain Exceptions carrying its message
            raise StorageError(f"selection query on {self.root} failed: {exc}\nSQL: {sql}") from exc

    def _window_rows(self, run_id: str, floor: int) -> dict[str, pa.Table]:
        """``run_id``'s window rows at ``floor``, from the tables as this thread keeps them."""
        rows = {}
        for name, schema in WINDOW_SCHEMAS.items():
            table = self.latest_table(name)
            if table is None:
                rows[name] = schema.empty_table()
                continue
            try:
                rows[name] = table.to_pyarrow_dataset().to_table(columns=schema.names,
                                                                 filter=window_filter(name, run_id, floor))
            except (DeltaError, OSError, pa.ArrowException) as exc:
                raise StorageError(f"reading {self.table_uri(name)} failed: {exc}") from exc
        return rows

    def table_versions(self) -> dict[str, int]:
        """Current version of each table; -1 for a table not created yet."""
        versions = {}
        for name in TABLE_SPECS:
            table = self.latest_table(name)
            versions[name] = -1 if table is None else table.version()
        return versions

    def compact(self, retention_hours: int | None = None) -> dict[str, object]:
        """Compact small files, write a checkpoint and vacuum each existing table.

        Vacuum deletes files that no version younger than ``retention_hours``
        references; None keeps the table's retention period (7 days by
        default), so readers of recent versions and concurrent writers are
        never broken. A shorter retention is only safe while no run writes
        (the caller checks) and ends time travel to the versions it cleans up.
        Returns ``{table: {files_added, files_removed, vacuumed_files, version}}``.
        """
        metrics: dict[str, object] = {}
        for name in TABLE_SPECS:
            table = self._open(name)
            if table is None:
                continue
            try:
                optimized = table.optimize.compact()
                table.create_checkpoint()
                vacuumed = table.vacuum(retention_hours=retention_hours, dry_run=False,
                                        enforce_retention_duration=retention_hours is None)
                table.cleanup_metadata()
            except DeltaError as exc:
                raise StorageError(f"compacting {self.table_uri(name)} failed: {exc}") from exc
            metrics[name] = {"files_added": optimized["numFilesAdded"],
                             "files_removed": optimized["numFilesRemoved"],
                             "vacuumed_files": len(vacuumed), "version": table.version()}
        return metrics


def _already_committed(table: DeltaTable, app_id: str, txn_version: int) -> bool:
    """Whether ``table`` already holds a commit of ``app_id`` at ``txn_version`` or later."""
    done = table.transaction_version(app_id)
    return done is not None and done >= txn_version


