"""Query results for people: a console table, or a CSV/Parquet/JSON-lines file.

Also parses ``--as-of-version TABLE=N`` (time travel per table).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa

OUTPUT_FORMATS = (".csv", ".parquet", ".jsonl")
_CELL_CHARS = 40


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
    shown = table.slice(0, max_rows).to_pylist()
    names = table.schema.names
    cells = [[_cell(row[n]) for n in names] for row in shown]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)
               for f in table.schema]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)] + [line(r) for r in cells]
    rest = table.num_rows - len(shown)
    out.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''}"
               + (f"; {rest} not shown, use --max-rows or --out FILE)" if rest else ")"))
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
        raise ValueError(f"--out {str(path)!r}: unknown format; use a file ending in {', '.join(OUTPUT_FORMATS)}")
    if path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a directory")
    if not path.parent.is_dir():
        raise ValueError(f"--out {str(path)!r}: directory {str(path.parent)!r} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        elif suffix == ".csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(_flatten_nested(table), tmp)
        else:
            with open(tmp, "w") as fh:
                for row in table.to_pylist():
                    fh.write(json.dumps(row, default=str) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
