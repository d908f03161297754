"""``reflow query`` and ``reflow maintain``: the commands over a run's (or a root's) Delta tables.

Both answer bad input (no such run, a foreign schema, an SQL error, a live
writer) with ``InputError`` before anything is written; ``infra.cli`` maps
it to exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reflow.infra.config import InputError


def open_target(args: argparse.Namespace):
    """The run's (or root's) store, its schemas checked; InputError if it cannot be found or read."""
    from reflow.infra.runs import RunNotFound, resolve_target
    from reflow.storage.delta_store import DeltaTrajectoryStore, StorageError

    try:
        target = resolve_target(args.run, args.root, args.runs)
        return target, DeltaTrajectoryStore(target.store_root)
    except (RunNotFound, StorageError) as exc:
        raise InputError(str(exc)) from None


def cmd_query(args: argparse.Namespace) -> int:
    from reflow.infra.tables import parse_as_of, format_table, write_result
    from reflow.storage.delta_store import TABLE_SPECS, StorageError

    if args.max_rows < 0:
        raise InputError("--max-rows must be >= 0")
    try:
        as_of = parse_as_of(args.as_of_version, tuple(TABLE_SPECS))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.out and Path(args.out).suffix.lower() not in (".csv", ".parquet", ".jsonl"):
        raise InputError(f"--out {args.out!r}: use a file ending in .csv, .parquet or .jsonl")
    target, store = open_target(args)
    try:
        result = store.query(args.sql, as_of=as_of)
    except StorageError as exc:
        raise InputError(str(exc)) from None
    if args.out:
        try:
            path = write_result(result, args.out)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        print(f"{result.num_rows} rows -> {path}")
    else:
        print(format_table(result, args.max_rows))
    return 0


def cmd_maintain(args: argparse.Namespace) -> int:
    if args.retention_hours is not None and args.retention_hours < 0:
        raise InputError("--retention-hours must be >= 0")
    target, store = open_target(args)  # refuses tables with another schema before anything is changed
    from reflow.infra.runlock import live_writers
    from reflow.tasks.maintenance import LiveWriterError, describe_writers

    writers = live_writers(target.run_dir, target.store_root)
    if writers and not args.force:
        raise InputError("a run is writing to these tables; maintenance would vacuum files it may still need. "
                         "Wait for it to finish (or pass --force if the lock is wrong):\n" + describe_writers(writers))
    before = store.table_versions()
    if all(v < 0 for v in before.values()):
        raise InputError(f"no reflow tables under {target.store_root}: nothing to maintain")
    from reflow.infra.cli import _prefect_api, _quiet_environment

    _quiet_environment(False)
    _prefect_api()
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
