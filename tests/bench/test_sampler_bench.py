from __future__ import annotations

import json
from pathlib import Path

from reflow.bench.sampler import MARKER, bench_sampler, check_root


def test_bench_sampler_builds_and_times_a_small_buffer(tmp_path: Path) -> None:
    figures = bench_sampler(2_000, str(tmp_path / "buffer"), rows_per_version=200, queries=3, groups_needed=8)
    assert sorted(p.name for p in (tmp_path / "buffer").iterdir()) == sorted([MARKER, "trajectories", "usage"])
    check_root(tmp_path / "buffer", rebuild=True)  # marked as the bench's: --rebuild may delete it
    json.dumps(figures)  # serialisable as promised
    assert figures["rows"] == 2_000 and figures["versions"] == 10 and figures["usage_rows"] > 0
    assert figures["window_rows"] == 5 * 200 and figures["kept_open"]["append_ms"] > 0
    for path in ("open_per_query", "kept_open", "whole_tables"):
        timing = figures[path]
        assert 0 < timing["p50_ms"] <= timing["p95_ms"] <= timing["max_ms"]
        assert timing["selected_rows_min"] == timing["selected_rows_max"] == 64  # 8 whole groups of 8
