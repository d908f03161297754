"""Latency of the ReFlow sampling query on a large synthetic buffer.

``bench_sampler(rows, root)`` writes ``rows`` trajectories of one run spread
over ``versions`` policy versions (``samples_per_prompt`` rows per group,
realistic ids and scalars, short token lists so the table builds quickly)
and a ``usage`` log as a ReFlow run would leave it: every group trained on
once within ``max_staleness_versions`` of its generation, a share of them
replayed once more inside the window. Tables are written with a few bulk
Arrow appends (not per-row records) and then compacted and checkpointed by
``store.compact()``. It then times ``select_batch`` at the newest trainer
version, alternating the two replay orders, once with a new store (every
table opened afresh) per query and once through one store that keeps its
tables open, as a run's selector does, appending a version and its usage
between selections as a run does; it returns JSON-serialisable figures
(``reflow bench-sampler``).
"""

from __future__ import annotations

import datetime as dt
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.replay import ReplayPolicy, select_batch, select_batch_sql
from reflow.storage.schema import TRAJECTORY_SCHEMA, USAGE_SCHEMA
from reflow.storage.store import TABLE_SPECS, TRAJECTORIES, USAGE, TrajectoryStore

RUN_ID = "bench-run"
# Written in a root the bench builds its tables in: --rebuild deletes only a root that holds it (or nothing).
MARKER = ".reflow-bench-sampler"
PROMPT_TOKENS = 24  # short lists keep the build fast; the scan never reads them
RESPONSE_TOKENS = 12


def _lists(n: int, width: int, values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """``n`` lists of ``width`` elements from the flat ``values``."""
    offsets = pa.array(np.arange(0, n * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=arrow_type.value_type)).cast(arrow_type)


def trajectory_table(versions: np.ndarray, groups_per_version: int, samples_per_prompt: int,
                     rng: np.random.Generator) -> pa.Table:
    """Synthetic trajectories for the policy versions in ``versions`` (one rollout step per version)."""
    per_version = groups_per_version * samples_per_prompt
    n = len(versions) * per_version
    version = np.repeat(versions, per_version).astype(np.int64)
    sample = np.tile(np.arange(samples_per_prompt), len(versions) * groups_per_version)
    group_ids = [f"{RUN_ID}/{v}/p{v * groups_per_version + p}" for v, p in
                 zip(np.repeat(versions, groups_per_version), np.tile(np.arange(groups_per_version), len(versions)))]
    group = np.repeat(np.array(group_ids, dtype=object), samples_per_prompt)
    reward = (rng.random(n) < 0.4).astype(np.float64)
    created = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    columns = {
        "trajectory_id": pa.array([f"{g}/{k}" for g, k in zip(group, sample)], pa.string()),
        "run_id": pa.array(np.full(n, RUN_ID, dtype=object), pa.string()),
        "prompt_id": pa.array([g.rsplit("/", 1)[1] for g in group], pa.string()),
        "group_id": pa.array(group, pa.string()),
        "sample_index": pa.array(sample, pa.int64()),
        "env": pa.array(np.full(n, "arithmetic", dtype=object), pa.string()),
        "rollout_step": pa.array(version, pa.int64()),
        "policy_version": pa.array(version, pa.int64()),
        "prompt_tokens": _lists(n, PROMPT_TOKENS, rng.integers(0, 32000, n * PROMPT_TOKENS, dtype=np.int32),
                                TRAJECTORY_SCHEMA.field("prompt_tokens").type),
        "response_tokens": _lists(n, RESPONSE_TOKENS, rng.integers(0, 32000, n * RESPONSE_TOKENS, dtype=np.int32),
                                  TRAJECTORY_SCHEMA.field("response_tokens").type),
        "behaviour_logprobs": _lists(n, RESPONSE_TOKENS, -rng.random(n * RESPONSE_TOKENS, dtype=np.float32) * 3,
                                     TRAJECTORY_SCHEMA.field("behaviour_logprobs").type),
        "token_versions": _lists(n, RESPONSE_TOKENS, np.repeat(version, RESPONSE_TOKENS).astype(np.int32),
                                 TRAJECTORY_SCHEMA.field("token_versions").type),
        "loss_mask": _lists(n, RESPONSE_TOKENS, np.ones(n * RESPONSE_TOKENS, dtype=np.int8),
                            TRAJECTORY_SCHEMA.field("loss_mask").type),
        "reward": pa.array(reward, pa.float64()),
        "correct": pa.array(reward > 0, pa.bool_()),
        "finish_reason": pa.array(np.full(n, "stop", dtype=object), pa.string()),
        "response_length": pa.array(np.full(n, RESPONSE_TOKENS, dtype=np.int64), pa.int64()),
        "created_at": pa.array(np.full(n, created), pa.timestamp("us", tz="UTC")),
    }
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def usage_table(trajectories: pa.Table, samples_per_prompt: int, last_trainer_version: int,
                max_staleness: int, replay_share: float, rng: np.random.Generator) -> pa.Table:
    """Usage rows of a ReFlow run up to ``last_trainer_version``, sorted by trainer version.

    Each group is trained on first at ``v + d`` (``d`` in 0..1), and with
    probability ``replay_share`` once more at ``v + d + e`` (``e`` in
    1..max_staleness - d); uses after ``last_trainer_version`` have not happened.
    """
    ids = trajectories.column("trajectory_id").to_numpy(zero_copy_only=False)
    version = trajectories.column("policy_version").to_numpy()[::samples_per_prompt]
    groups = len(version)
    first = version + rng.integers(0, 2, groups)
    second = first + 1 + rng.integers(0, 10**6, groups) % np.maximum(max_staleness - (first - version), 1)
    replayed = (rng.random(groups) < replay_share) & (second - version <= max_staleness)
    used_at = np.concatenate([first, second[replayed]])
    group_index = np.concatenate([np.arange(groups), np.arange(groups)[replayed]])
    keep = used_at <= last_trainer_version
    used_at, group_index = used_at[keep], group_index[keep]
    order = np.argsort(used_at, kind="stable")
    used_at, group_index = used_at[order], group_index[order]
    rows = (group_index[:, None] * samples_per_prompt + np.arange(samples_per_prompt)).ravel()
    tv = np.repeat(used_at, samples_per_prompt).astype(np.int64)
    pv = version[np.repeat(group_index, samples_per_prompt)]
    n = len(rows)
    created = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    columns = {
        "run_id": pa.array(np.full(n, RUN_ID, dtype=object), pa.string()),
        "trajectory_id": pa.array(ids[rows], pa.string()),
        "trainer_step": pa.array(tv, pa.int64()),
        "trainer_version": pa.array(tv, pa.int64()),
        "loss_weight": pa.array(np.ones(n), pa.float64()),
        "staleness": pa.array(tv - pv, pa.int64()),
        "created_at": pa.array(np.full(n, created), pa.timestamp("us", tz="UTC")),
    }
    return pa.Table.from_pydict(columns, schema=USAGE_SCHEMA)


def build_buffer(root: str, rows: int, versions: int, samples_per_prompt: int, max_staleness: int,
                 appends: int, compact: bool, seed: int = 0) -> dict[str, float]:
    """Write the synthetic ``trajectories`` and ``usage`` tables under ``root``; return timings (s).

    Each table gets ``appends`` bulk appends covering consecutive version
    ranges (``appends == versions`` is the layout a live run leaves: one
    commit per step), then ``store.compact()`` if ``compact``.
    """
    rng = np.random.default_rng(seed)
    groups_per_version = max(1, rows // (versions * samples_per_prompt))
    store = DeltaTrajectoryStore(root)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    usage_parts = []
    for chunk in np.array_split(np.arange(versions), appends):
        part = trajectory_table(chunk, groups_per_version, samples_per_prompt, rng)
        _append(store, TRAJECTORIES, part)
        usage_parts.append(usage_table(part.select(["trajectory_id", "policy_version"]), samples_per_prompt,
                                       versions - 2, max_staleness, 0.5, rng))
    timings["write_trajectories_s"] = time.perf_counter() - start
    start = time.perf_counter()
    usage = pa.concat_tables(usage_parts)
    usage = usage.take(np.argsort(usage.column("trainer_version").to_numpy(), kind="stable"))
    used_at = usage.column("trainer_version").to_numpy()
    for chunk in np.array_split(np.arange(versions), appends):
        lo, hi = np.searchsorted(used_at, [chunk[0], chunk[-1] + 1]) if len(chunk) else (0, 0)
        if hi > lo:
            _append(store, USAGE, usage.slice(lo, hi - lo))
    timings["write_usage_s"] = time.perf_counter() - start
    if compact:
        start = time.perf_counter()
        store.compact()
        timings["compact_s"] = time.perf_counter() - start
    return timings


def _append(store: DeltaTrajectoryStore, name: str, data: pa.Table) -> None:
    """Bulk-append Arrow ``data`` to table ``name`` (created with its reflow spec if absent)."""
    spec = TABLE_SPECS[name]
    write_deltalake(store.table_uri(name), data, mode="append", partition_by=list(spec.partition_by) or None,
                    name=spec.name)


def check_root(root: str | Path, rebuild: bool) -> None:
    """ValueError unless ``root`` is absent, empty, or a root this bench built: its marker, ``trajectories`` and
    ``usage`` and nothing else (``rebuild`` deletes it, and without ``rebuild`` the bench appends synthetic rows
    to the tables it finds, so a folder of the user's, or a run's tables, is refused)."""
    path = Path(root)
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"--root: {str(path)!r} is a file, not a directory")
    names = {p.name for p in path.iterdir()}
    if not names:
        return
    other = sorted(names - {MARKER, TRAJECTORIES, USAGE})
    if other:
        raise ValueError(f"--root: {str(path)!r} holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, "
                         "not only the bench's tables; choose an empty or new directory")
    if MARKER not in names:  # tables of a run, or of the user's: neither appended to nor deleted
        raise ValueError(f"--root: {str(path)!r} has no {MARKER} (not built by this bench), so the bench will "
                         f"neither {'delete it' if rebuild else 'add its rows to it'}; choose an empty or new "
                         "directory")


def bench_sampler(rows: int, root: str, rows_per_version: int = 4000, queries: int = 50, samples_per_prompt: int = 8,
                  groups_needed: int = 64, max_staleness: int = 4, appends: int = 4, compact: bool = True,
                  rebuild: bool = False) -> dict[str, object]:
    """Build (or reuse) a ``rows``-trajectory buffer under ``root`` and time ``select_batch`` on it.

    The table grows as a run's does, by versions: ``rows_per_version`` rows
    each (default 4,000: 500 groups of 8, the shape of the issue's 1M-row
    figures), so ``rows / rows_per_version`` versions. A 64-group batch,
    staleness bound 4, replay ratio 0.25, reuse cap 2, the two replay orders
    in turn. Two figures:

    - ``kept_open``: one store, as a run's selector keeps it. Each query is
      a step: one new version of trajectories is appended, the selection at
      that version is timed, its usage rows are appended (appends untimed,
      ``append_ms`` their mean). The first selection reads the window from
      the tables (``first_ms``); later ones use what the commits fed it.
    - ``open_per_query``: a new store per selection, so the window is read
      from the tables each time: what the first selection of a process (a
      resumed run) pays once.
    - ``whole_tables``: at each step, the same SQL over the whole Delta
      tables (``store.query``, kept open), as selections ran before the
      window (at the step's next version, after its usage rows).

    Returns ``{rows, usage_rows, versions, files, build timings,
    window_rows, kept_open: {p50_ms, p95_ms, max_ms, first_ms, append_ms, ...},
    open_per_query: {...}, whole_tables: {...}}``; ``rows`` and ``versions`` as built, before the
    timed steps add theirs.
    """
    path = Path(root)
    check_root(path, rebuild)
    if rebuild and path.exists():
        shutil.rmtree(path)
    timings: dict[str, float] = {}
    versions = max(1, rows // rows_per_version)
    if not (path / TRAJECTORIES).exists():
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text("built by reflow bench-sampler; --rebuild deletes this directory\n")
        timings = build_buffer(root, rows, versions, samples_per_prompt, max_staleness, appends, compact)
    store = DeltaTrajectoryStore(root)
    trajectories, usage = DeltaTable(store.table_uri(TRAJECTORIES)), DeltaTable(store.table_uri(USAGE))
    newest = max(int(p["policy_version"]) for p in trajectories.partitions())
    built = trajectories.count()
    figures: dict[str, object] = {
        "rows": built, "usage_rows": usage.count(), "versions": newest + 1,
        "rows_per_version": built // (newest + 1),
        "trajectory_files": len(trajectories.file_uris()), "usage_files": len(usage.file_uris()),
        "table_versions": store.table_versions(), **{k: round(v, 2) for k, v in timings.items()},
        "queries": queries, "groups_needed": groups_needed, "max_staleness_versions": max_staleness,
        "window_rows": (max_staleness + 1) * (built // (newest + 1)),
    }
    policies = [ReplayPolicy(max_staleness, 0.25, 2, order) for order in ("newest", "advantage")]
    figures["open_per_query"] = _time_cold(root, newest, groups_needed, policies, samples_per_prompt, queries)
    figures["kept_open"], figures["whole_tables"] = _time_steps(store, newest, groups_needed, policies,
                                                                samples_per_prompt, queries, built // (newest + 1))
    return figures


def _select(store: TrajectoryStore, tv: int, groups_needed: int, policy: ReplayPolicy,
            samples_per_prompt: int) -> tuple[float, object]:
    start = time.perf_counter()
    selection = select_batch(store, RUN_ID, tv, groups_needed, policy, samples_per_prompt=samples_per_prompt)
    return (time.perf_counter() - start) * 1000, selection


def _time_cold(root: str, tv: int, groups_needed: int, policies: list[ReplayPolicy], samples_per_prompt: int,
               queries: int) -> dict[str, float]:
    """Selections at version ``tv``, each through a new store (the window read from the tables every time)."""
    latencies, selected = [], []
    for i in range(queries + 2):
        ms, selection = _select(DeltaTrajectoryStore(root), tv, groups_needed, policies[i % 2], samples_per_prompt)
        if i >= 2:  # the first two warm caches (imports, page cache)
            latencies.append(ms)
            selected.append(len(selection.trajectory_ids))
    return _figures(latencies, selected)


def _time_steps(store: DeltaTrajectoryStore, newest: int, groups_needed: int, policies: list[ReplayPolicy],
                samples_per_prompt: int, queries: int, rows_per_version: int) -> tuple[dict, dict]:
    """``queries`` steps of a run through one store: append a version, time its selection, log its usage.

    Each step also times the same SQL over the whole Delta tables (``store.query``, kept open: how
    selections ran before the window), so the two are compared in one invocation.
    """
    rng = np.random.default_rng(1)
    groups_per_version = max(1, rows_per_version // samples_per_prompt)
    latencies, selected, appends, whole, whole_selected = [], [], [], [], []
    first = 0.0
    for i in range(queries + 1):
        tv = newest + 1 + i
        policy = policies[i % 2]
        start = time.perf_counter()
        store.append_arrow(TRAJECTORIES, trajectory_table(np.array([tv]), groups_per_version, samples_per_prompt, rng),
                           app_id="bench:trajectories", txn_version=tv)
        ms, selection = _select(store, tv, groups_needed, policy, samples_per_prompt)
        store.append_usage(selection.usage_rows(RUN_ID, tv, tv), app_id="bench:usage", txn_version=tv)
        if i == 0:
            first = ms  # the window read from the tables
            continue
        latencies.append(ms)
        selected.append(len(selection.trajectory_ids))
        appends.append((time.perf_counter() - start) * 1000 - ms)
        sql = select_batch_sql(RUN_ID, tv + 1, groups_needed, policy, samples_per_prompt=samples_per_prompt)
        started = time.perf_counter()
        rows = store.query(sql).num_rows
        whole.append((time.perf_counter() - started) * 1000)
        whole_selected.append(rows)
    return ({**_figures(latencies, selected), "first_ms": round(first, 2),
             "append_ms": round(statistics.fmean(appends), 2)}, _figures(whole, whole_selected))


def _figures(latencies: list[float], selected: list[int]) -> dict[str, float]:
    latencies = sorted(latencies)
    return {"p50_ms": round(statistics.median(latencies), 2),
            "p95_ms": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 2),
            "max_ms": round(latencies[-1], 2), "selected_rows_min": min(selected),
            "selected_rows_max": max(selected)}
