"""``reflow query`` and ``reflow maintain``: the commands over a run's (or a root's) Delta tables.

Query results go to people as a console table, or to a CSV/Parquet/JSON-lines
file; ``--as-of-version TABLE=N`` reads a table at an older version (time
travel). Both commands answer bad input (no such run, a foreign schema, an
SQL error, a live writer) with ``InputError`` before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from reflow.cli.runtime import prefect_api_starting, quiet_environment
from reflow.config.load import InputError
from reflow.infra.runlock import LiveWriterError, describe_writers, live_writers
from reflow.infra.runs import RunNotFound, resolve_target
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.store import TABLE_SPECS, StorageError

OUTPUT_FORMATS = (".csv", ".parquet", ".jsonl")
_CELL_CHARS = 40
MAX_RETENTION_HOURS = 1_000_000  # delta-rs takes hours as a duration that overflows past about 2.5e12
# What a query may start with: DataFusion runs any statement, and COPY ... TO, CREATE ... and EXPLAIN ANALYZE
# COPY write files or change the session, which a read-only command must not.
_READ_ONLY_START = re.compile(r"(SELECT|WITH|VALUES)\b|\(", re.IGNORECASE)
_LEADING = re.compile(r"(\s+|--[^\n]*(\n|$)|/\*.*?\*/)*", re.DOTALL)  # whitespace and comments
_EXPLAIN = re.compile(r"EXPLAIN(\s+ANALYZE)?(\s+VERBOSE)?(\s+FORMAT\s+\w+)?\s+", re.IGNORECASE)


def check_read_only(sql: str) -> None:
    """InputError unless ``sql`` is one read-only query: SELECT, WITH, VALUES, or an EXPLAIN of one."""
    body = sql[_LEADING.match(sql).end():]
    explain = _EXPLAIN.match(body)
    if explain:
        body = body[explain.end():]
        body = body[_LEADING.match(body).end():]
    if not _READ_ONLY_START.match(body):
        first = body.split(None, 1)[0] if body.strip() else "nothing"
        raise InputError(f"SQL: query reads the tables only; expected a SELECT, WITH or VALUES query, got "
                         f"{first[:20]!r}")


def parse_as_of(items: list[str], tables: tuple[str, ...]) -> dict[str, int]:
    """``["trajectories=5", ...]`` to ``{"trajectories": 5}``; ValueError naming the bad item."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in tables:
            raise ValueError(f"--as-of-version {item!r}: expected TABLE=VERSION with TABLE one of {', '.join(tables)}")
        try:
            version = int(raw)
        except ValueError:
            raise ValueError(f"--as-of-version {item!r}: the version must be an integer") from None
        if version < 0:
            raise ValueError(f"--as-of-version {item!r}: the version must be >= 0")
        if name in out and out[name] != version:
            raise ValueError(f"--as-of-version: table {name!r} given twice")
        out[name] = version
    return out


def _cell(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text if len(text) <= _CELL_CHARS else text[:_CELL_CHARS - 3] + "..."


def format_table(table: pa.Table, max_rows: int) -> str:
    """``table`` as aligned text (numbers right-aligned), at most ``max_rows`` rows, then a row count."""
    shown = table.slice(0, min(max_rows, table.num_rows)).to_pylist()  # a huge --max-rows overflows Arrow
    names = table.schema.names
    cells = [[_cell(row[n]) for n in names] for row in shown]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)
               for f in table.schema]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    if not names:  # a statement that returns no columns
        return f"(no columns; {table.num_rows} row{'s' if table.num_rows != 1 else ''})"
    out = [line(names), "  ".join("-" * w for w in widths)] + [line(r) for r in cells]
    rest = table.num_rows - len(shown)
    out.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''}"
               + (f"; {rest} not shown, use --max-rows or --output FILE)" if rest else ")"))
    return "\n".join(out)


def _flatten_nested(table: pa.Table) -> pa.Table:
    """List and struct columns as JSON text (CSV has no nested types)."""
    columns = []
    for field, column in zip(table.schema, table.columns):
        if pa.types.is_nested(field.type):
            column = pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()],
                              pa.string())
        columns.append(column)
    return pa.table(columns, names=table.schema.names)


def write_result(table: pa.Table, path: str | Path) -> Path:
    """Write ``table`` to ``path`` by its extension (.csv, .parquet, .jsonl), atomically (temp file, rename)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise ValueError(f"--output {str(path)!r}: unknown format; use a file ending in {', '.join(OUTPUT_FORMATS)}")
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a directory")
    if not path.parent.is_dir():
        raise ValueError(f"--output {str(path)!r}: directory {str(path.parent)!r} does not exist")
    table_dir = next((d for d in path.resolve().parents if (d / "_delta_log").is_dir()), None)
    if table_dir is not None:  # a file written there would replace, or be read as, part of the table
        raise ValueError(f"--output {str(path)!r} is inside the Delta table {str(table_dir)!r}; write it elsewhere")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if suffix == ".parquet":
            pq.write_table(table, tmp)
        elif suffix == ".csv":
            pacsv.write_csv(_flatten_nested(table), tmp)
        else:
            with open(tmp, "w") as fh:
                for row in table.to_pylist():
                    fh.write(json.dumps(row, default=str) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def open_target(args: argparse.Namespace):
    """The run's (or root's) store, its schemas checked; InputError if it cannot be found or read."""
    try:
        target = resolve_target(args.run, args.root, args.runs)
        return target, DeltaTrajectoryStore(target.store_root)
    except (RunNotFound, StorageError) as exc:
        raise InputError(str(exc)) from None


def cmd_query(args: argparse.Namespace) -> int:
    if args.max_rows < 0:
        raise InputError("--max-rows must be >= 0")
    try:
        as_of = parse_as_of(args.as_of_version, tuple(TABLE_SPECS))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    check_read_only(args.sql)
    if args.output and Path(args.output).suffix.lower() not in (".csv", ".parquet", ".jsonl"):
        raise InputError(f"--output {args.output!r}: use a file ending in .csv, .parquet or .jsonl")
    target, store = open_target(args)
    try:
        result = store.query(args.sql, as_of=as_of)
    except StorageError as exc:
        raise InputError(str(exc)) from None
    if args.output:
        try:
            path = write_result(result, args.output)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        print(f"{result.num_rows} rows -> {path}")
    else:
        print(format_table(result, args.max_rows))
    return 0


def cmd_maintain(args: argparse.Namespace) -> int:
    if args.retention_hours is not None and not 0 <= args.retention_hours <= MAX_RETENTION_HOURS:
        raise InputError(f"--retention-hours must be between 0 and {MAX_RETENTION_HOURS:,} (about 114 years)")
    target, store = open_target(args)  # refuses tables with another schema before anything is changed
    writers = live_writers(target.run_dir, target.store_root)
    if writers and not args.force:
        raise InputError("a run is writing to these tables; maintenance would vacuum files it may still need. "
                         "Wait for it to finish (or pass --force if the lock is wrong):\n" + describe_writers(writers))
    before = store.table_versions()
    if all(v < 0 for v in before.values()):
        raise InputError(f"no reflow tables under {target.store_root}: nothing to maintain")
    quiet_environment(False)
    with prefect_api_starting():  # the flow imports (about 8 s) while the API server starts
        from reflow.flows.maintain import maintain

    run_dir = str(target.run_dir) if target.run_dir is not None else None
    try:
        metrics = maintain(store_root=target.store_root, run_dir=run_dir, retention_hours=args.retention_hours,
                           force=args.force)
    except LiveWriterError as exc:  # a run started between the check above and the flow's own
        raise InputError(str(exc)) from None
    for name, m in metrics.items():
        print(f"{name:14s} version {before[name]} -> {m['version']}: {m['files_removed']} files compacted into "
              f"{m['files_added']}, {m['vacuumed_files']} vacuumed")
    return 0
