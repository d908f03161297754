"""`reflow query` and `reflow maintain` on small Delta tables written here through the project's store.

Bad input (a wrong run, a table of another schema, a SQL error, a live
writer) exits 2 with a message and leaves every file of the tables as it was.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from reflow.cli import main as cli
from reflow.infra.run import RunRecord
from reflow.infra.runlock import LOCK_NAME, WriterLock, lock_paths
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.schema import Trajectory, Usage

REPO = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
STEPS, GROUPS, SAMPLES = 3, 2, 2


def _trajectory(run_id: str, step: int, group: int, sample: int) -> Trajectory:
    n = 2 + (step + group + sample) % 4
    correct = (group + sample + step) % 2 == 0
    return Trajectory(trajectory_id=f"{run_id}/{step}/{group}/{sample}", run_id=run_id, prompt_id=f"p{step}-{group}",
                      group_id=f"{step}/{group}", sample_index=sample, env="arith", rollout_step=step,
                      policy_version=step, prompt_tokens=[1, 2, 3], response_tokens=list(range(n)),
                      behaviour_logprobs=[-0.5] * n, token_versions=[step] * n, loss_mask=[1] * n,
                      reward=float(correct), correct=correct, finish_reason="stop", response_length=n,
                      created_at=T0 + dt.timedelta(seconds=step))


def make_run(runs: Path, name: str = "demo-20260101-000000-000") -> Path:
    """A run directory whose tables hold 3 steps (a commit per group and per usage batch); step k trains on k
    and k-1."""
    run_dir = runs / name
    run_dir.mkdir(parents=True)
    store = DeltaTrajectoryStore(run_dir / "tables")
    by_step = {}
    for step in range(STEPS):
        rows = [_trajectory(name, step, g, s) for g in range(GROUPS) for s in range(SAMPLES)]
        by_step[step] = rows
        for g in range(GROUPS):  # one commit per group: several small files per partition, as the feeder writes
            store.append_trajectories(rows[g * SAMPLES:(g + 1) * SAMPLES], app_id=f"{name}:rollout",
                                      txn_version=step * GROUPS + g)
        batch = rows + (by_step[step - 1][:2] if step else [])  # two replayed samples from the previous step
        store.append_usage([Usage(run_id=name, trajectory_id=t.trajectory_id, trainer_step=step,
                                  trainer_version=step, loss_weight=1.0, staleness=step - t.policy_version,
                                  created_at=T0) for t in batch], app_id=f"{name}:usage", txn_version=step)
    record = RunRecord(run_id=name, run_dir=str(run_dir), store_root=str(run_dir / "tables"), model_dir="m",
                       namespace="ns", engines=("e",), trainer="t", tracking_uri="none")
    (run_dir / "run.json").write_text(record.model_dump_json())
    return run_dir


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time (ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def reflow(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def prefect_api():
    """The maintenance flow runs against a temporary Prefect API, stopped cleanly after the module."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "runs")


def test_query_prints_a_table_and_writes_files(run_dir: Path, tmp_path: Path, capsys) -> None:
    code, out, err = reflow(["query", "SELECT policy_version, count(*) AS n FROM trajectories GROUP BY policy_version "
                             "ORDER BY policy_version", str(run_dir)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["policy_version", "n"]
    assert [line.split() for line in lines[2:5]] == [["0", "4"], ["1", "4"], ["2", "4"]]
    assert lines[-1] == "(3 rows)"

    sql = "SELECT trajectory_id, response_tokens, reward FROM trajectories ORDER BY trajectory_id"
    for suffix in (".csv", ".parquet", ".jsonl"):
        target = tmp_path / f"result{suffix}"
        code, out, err = reflow(["query", sql, str(run_dir), "--output", str(target)], capsys)
        assert code == 0, err
        assert f"12 rows -> {target}" in out
    back = pq.read_table(tmp_path / "result.parquet")
    assert back.num_rows == 12 and back.column("response_tokens").type == pa.list_(pa.int32())
    csv_lines = (tmp_path / "result.csv").read_text().splitlines()
    assert len(csv_lines) == 13 and "[0, 1" in csv_lines[1]  # list cells as JSON text
    first = json.loads((tmp_path / "result.jsonl").read_text().splitlines()[0])
    assert first["trajectory_id"] == back.column("trajectory_id")[0].as_py()


def test_query_defaults_to_the_latest_run(tmp_path: Path, capsys, monkeypatch) -> None:
    make_run(tmp_path / "runs", "a-20260101-000000-000")
    newer = make_run(tmp_path / "runs", "b-20260102-000000-000")
    monkeypatch.chdir(tmp_path)
    code, out, _ = reflow(["query", "SELECT DISTINCT run_id FROM usage"], capsys)
    assert code == 0 and newer.name in out and "a-2026" not in out


def test_query_as_of_version_reads_an_earlier_table(run_dir: Path, capsys) -> None:
    sql = "SELECT count(*) AS n FROM usage"
    latest = reflow(["query", sql, str(run_dir)], capsys)[1]
    first = reflow(["query", sql, str(run_dir), "--as-of-version", "usage=1"], capsys)[1]
    assert latest.splitlines()[2].strip() == str(4 + 6 + 6)
    assert first.splitlines()[2].strip() == "4"  # version 1 is the first append (step 0)


def test_documented_queries_run(run_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Every `reflow query` command shown in the README and in docs/operations.md runs against a run's tables."""
    text = (REPO / "README.md").read_text() + (REPO / "docs" / "operations.md").read_text()
    commands = [shlex.split(m) for m in re.findall(r"^reflow query .*$", text, flags=re.M)]
    commands = [argv for argv in commands if "--root" not in argv]  # the run: appended
    assert len(commands) >= 4
    monkeypatch.chdir(tmp_path)  # --output files land here
    for argv in commands:
        code, out, err = reflow(argv[1:] + [str(run_dir)], capsys)
        assert code == 0, (argv, err)
        assert "row" in out, (argv, out)


def test_query_bad_input_exits_2_and_changes_nothing(run_dir: Path, tmp_path: Path, capsys) -> None:
    tables = run_dir / "tables"
    before = files_of(tables)
    cases = [
        (["SELECT 1", str(tmp_path / "nope")], "is not a run directory"),
        (["SELECT 1", str(tables)], "pass it as --root"),
        (["SELEC * FROM usage", str(run_dir)], "got 'SELEC'"),
        (["SELECT * FROM usage WHERE", str(run_dir)], "ParserError"),
        (["SELECT nope FROM usage", str(run_dir)], "No field named nope"),
        (["SELECT * FROM rollout_cache", str(run_dir)], "'rollout_cache' does not exist yet"),
        (["SELECT 1", str(run_dir), "--as-of-version", "usage=99"], "version 99 does not exist"),
        (["SELECT 1", str(run_dir), "--as-of-version", "usagee=1"], "TABLE=VERSION"),
        (["SELECT 1", str(run_dir), "--output", str(tmp_path / "x.xlsx")], ".csv, .parquet or .jsonl"),
        (["SELECT 1", str(run_dir), "--output", str(tmp_path / "no/dir/x.csv")], "does not exist"),
        ([f"COPY (SELECT 1 AS a) TO '{tmp_path / 'copy.csv'}' STORED AS CSV", str(run_dir)], "got 'COPY'"),
        ([f"EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{tmp_path / 'copy.csv'}' STORED AS CSV", str(run_dir)],
         "got 'COPY'"),
        (["CREATE TABLE t AS SELECT 1", str(run_dir)], "got 'CREATE'"),
        (["SELECT 1 AS x", str(run_dir), "--output", str(next((tables / "usage").glob("*.parquet")))],
         "is inside the Delta table"),  # it would replace one of the table's files
        (["SELECT 1 AS x", str(run_dir), "--output", str(tables / "usage" / "new.csv")], "is inside the Delta table"),
    ]
    for args, message in cases:
        code, out, err = reflow(["query", *args], capsys)
        assert code == 2, (args, out, err)
        assert message in err and "Traceback" not in err, (args, err)
    assert files_of(tables) == before
    assert not (tmp_path / "x.xlsx").exists() and not (tmp_path / "copy.csv").exists()


def test_a_result_without_columns_prints_a_short_line(run_dir: Path, capsys) -> None:
    from reflow.cli.tables import format_table

    assert format_table(pa.table({}), 50) == "(no columns; 0 rows)"
    assert format_table(pa.table({"a": [1, 2]}), 2**63) == format_table(pa.table({"a": [1, 2]}), 2)  # no overflow
    code, out, _ = reflow(["query", "-- a comment\nSELECT 1 INTO t", str(run_dir)], capsys)
    assert (code, out) == (0, "(no columns; 0 rows)\n")


def test_sql_error_from_the_command_line_has_no_traceback(run_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "reflow.cli.main", "query", "SELECT * FROM usage WHERE",
                           str(run_dir)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: query on ") and "SQL error" in proc.stderr
    assert "Traceback" not in proc.stderr


def _foreign_usage(run_dir: Path) -> None:
    """Replace the usage table by a Delta table of another schema (another project's table)."""
    import shutil

    shutil.rmtree(run_dir / "tables" / "usage")
    write_deltalake(str(run_dir / "tables" / "usage"), pa.table({"user": ["a"], "clicks": [3]}))


def test_table_of_another_schema_is_refused(run_dir: Path, capsys) -> None:
    _foreign_usage(run_dir)
    before = files_of(run_dir / "tables")
    for args in (["query", "SELECT count(*) FROM trajectories"], ["maintain", "--retention-hours", "0"]):
        code, _, err = reflow([*args, str(run_dir)], capsys)
        assert code == 2, args
        assert "does not have the reflow usage schema" in err and "missing column 'trajectory_id'" in err
    assert files_of(run_dir / "tables") == before


def test_maintain_compacts_and_vacuums_keeping_the_rows(run_dir: Path, capsys, prefect_api) -> None:
    sql = "SELECT trajectory_id, trainer_step FROM usage ORDER BY trajectory_id, trainer_step"
    rows_before = reflow(["query", sql, str(run_dir), "--max-rows", "100"], capsys)[1]
    data_before = [p for p in (run_dir / "tables").rglob("*.parquet")]
    code, out, err = reflow(["maintain", str(run_dir), "--retention-hours", "0"], capsys)
    assert code == 0, err
    for table, files_before, files_after in (("trajectories", 6, 3), ("usage", 3, 1)):  # 3 partitions / 1
        assert re.search(rf"{table} +version \d+ -> \d+: {files_before} files compacted into {files_after}, "
                         rf"{files_before} vacuumed", out), out
    assert reflow(["query", sql, str(run_dir), "--max-rows", "100"], capsys)[1] == rows_before
    data_after = [p for p in (run_dir / "tables").rglob("*.parquet")]
    assert len(data_after) < len(data_before)
    assert (run_dir / "tables/usage/_delta_log/00000000000000000004.checkpoint.parquet").is_file()
    # retention 0 removed the files of earlier versions: time travel there now fails, with a message
    code, _, err = reflow(["query", "SELECT trajectory_id FROM usage", str(run_dir), "--as-of-version",
                           "usage=1"], capsys)
    assert code == 2 and "usage" in err and "Traceback" not in err, err


def test_maintain_default_retention_keeps_recent_files(run_dir: Path, capsys, prefect_api) -> None:
    code, out, err = reflow(["maintain", str(run_dir)], capsys)
    assert code == 0, err
    assert "0 vacuumed" in out
    code, out, _ = reflow(["query", "SELECT count(*) AS n FROM usage", str(run_dir), "--as-of-version",
                           "usage=1"], capsys)
    assert code == 0 and out.splitlines()[2].strip() == "4"  # time travel still works


def test_maintain_refuses_while_a_run_writes(run_dir: Path, capsys, prefect_api) -> None:
    lock = WriterLock(lock_paths(run_dir, str(run_dir / "tables"), run_dir.name), run_dir.name).acquire()
    try:
        before = files_of(run_dir / "tables")
        code, _, err = reflow(["maintain", str(run_dir), "--retention-hours", "0"], capsys)
        assert code == 2
        assert "a run is writing to these tables" in err and f"pid {os.getpid()}" in err
        assert files_of(run_dir / "tables") == before
        # the store root alone (as for a shared storage.root) carries the lock too
        code, _, err = reflow(["maintain", "--root", str(run_dir / "tables")], capsys)
        assert code == 2 and "a run is writing" in err
        assert files_of(run_dir / "tables") == before
    finally:
        lock.release()
    assert not (run_dir / LOCK_NAME).exists()
    code, _, err = reflow(["maintain", str(run_dir)], capsys)
    assert code == 0, err


def test_maintain_ignores_the_lock_of_a_killed_run(run_dir: Path, capsys, prefect_api) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / LOCK_NAME).write_text(json.dumps({"run_id": run_dir.name, "pid": dead.pid, "host": os.uname().nodename,
                                                 "started_at": T0.isoformat(), "heartbeat_at": T0.isoformat()}))
    code, out, err = reflow(["maintain", str(run_dir)], capsys)
    assert code == 0, err
    assert "compacted" in out


def test_maintain_bad_input_exits_2(tmp_path: Path, run_dir: Path, capsys) -> None:
    before = files_of(run_dir / "tables")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["nope", "--runs", str(tmp_path / "runs")], "no run 'nope'"),
             (["--runs", str(tmp_path / "none")], "no runs directory"),
             (["--root", str(empty)], "no reflow tables"),
             ([str(run_dir), "--retention-hours", "-1"], "--retention-hours"),
             ([str(run_dir), "--retention-hours", str(10**13)], "between 0 and 1,000,000"),  # delta-rs overflows
             ([str(run_dir), "--root", str(empty)], "not both")]
    for args, message in cases:
        code, _, err = reflow(["maintain", *args], capsys)
        assert code == 2 and message in err, (args, err)
    assert files_of(run_dir / "tables") == before
    assert os.listdir(empty) == []


def test_maintain_flow_checks_the_lock_itself(run_dir: Path, prefect_api) -> None:
    """A scheduled flow run (no command line in front) refuses too, and changes nothing."""
    from reflow.flows.maintain import maintain
    from reflow.tasks.maintenance import LiveWriterError

    lock = WriterLock(lock_paths(run_dir, str(run_dir / "tables"), "live"), "live").acquire()
    try:
        before = files_of(run_dir / "tables")
        with pytest.raises(LiveWriterError, match="run live"):
            maintain(store_root=str(run_dir / "tables"), retention_hours=0)
        assert files_of(run_dir / "tables") == before
        forced = maintain(store_root=str(run_dir / "tables"), retention_hours=0, force=True)
    finally:
        lock.release()
    assert forced["usage"]["files_removed"] == 3


@pytest.mark.parametrize("config", ["[]", '{"storage": "x"}', '{"storage": {"root": 5}}'])
def test_a_starting_run_with_a_config_that_is_not_a_run_config_exits_2(tmp_path: Path, capsys, config: str) -> None:
    run = tmp_path / "runs" / "starting"
    run.mkdir(parents=True)
    (run / "config.json").write_text(config)
    for args in (["query", "SELECT 1", str(run)], ["maintain", str(run)]):
        code, _, err = reflow(args, capsys)
        assert code == 2 and "is not a reflow run config" in err and "Traceback" not in err, (args, err)
    assert os.listdir(run) == ["config.json"]
