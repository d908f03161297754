"""Write the small dataset fixtures under ``envs/fixtures/`` (the real file formats, our own synthetic rows).

    python -m reflow.envs.make_fixtures [out_dir]

- ``math_dapo.parquet``: verl / DAPO-Math-17K rows (``data_source``, ``prompt``
  as chat messages, ``ability``, ``reward_model`` {ground_truth, style},
  ``extra_info`` with an index);
- ``math_plain.jsonl``: ``question`` / ``answer`` rows, answers written in
  LaTeX (``\\frac{7}{3}``) to exercise equivalence;
- ``code_apps.jsonl`` and ``code_apps.parquet``: APPS rows (``question``,
  ``input_output`` as a JSON string, ``starter_code``, ``solutions``,
  ``difficulty``), both stdin and ``fn_name`` problems; as in APPS, the
  ``fn_name`` problems carry starter code (``def f(n):``), which the synthetic
  CPU dataset leaves out.

The rows come from the synthetic generators with a fixed seed, so rerunning the
script rewrites the same rows.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from reflow.envs.code_env import synthetic_code_row
from reflow.envs.math_env import synthetic_math_row

FIXTURES = Path(__file__).with_name("fixtures")
ROWS = 12
SEED = 7


def _latex(truth: str) -> str:
    if "/" not in truth:
        return truth
    num, den = truth.split("/")
    return f"\\frac{{{num}}}{{{den}}}"


def _with_starter(row: dict[str, Any]) -> dict[str, Any]:
    if "fn_name" not in json.loads(row["input_output"]):
        return row
    return {**row, "starter_code": "def f(n):"}


def write_fixtures(out_dir: Path = FIXTURES) -> list[Path]:
    """Write the four fixture files into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    math_rows = [synthetic_math_row(rng, 20) for _ in range(ROWS)]
    dapo = [{**{k: v for k, v in row.items() if k != "extra_info"}, "extra_info": {"index": f"fixture-{i}"}}
            for i, row in enumerate(math_rows)]
    plain = [{"question": row["prompt"][0]["content"], "answer": _latex(row["reward_model"]["ground_truth"])}
             for row in math_rows]
    code_rows = [_with_starter(synthetic_code_row(rng, 20)) for _ in range(ROWS)]
    paths = [out_dir / "math_dapo.parquet", out_dir / "math_plain.jsonl", out_dir / "code_apps.jsonl",
             out_dir / "code_apps.parquet"]
    pq.write_table(pa.Table.from_pylist(dapo), paths[0])
    paths[1].write_text("".join(json.dumps(r) + "\n" for r in plain))
    paths[2].write_text("".join(json.dumps(r) + "\n" for r in code_rows))
    pq.write_table(pa.Table.from_pylist(code_rows), paths[3])
    return paths


if __name__ == "__main__":
    for path in write_fixtures(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES):
        print(path)
