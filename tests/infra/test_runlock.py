"""The writer lock: live while its process runs, not after it is killed, gone after a clean release."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reflow.infra.runlock import (
    LOCK_NAME,
    WRITERS_DIR,
    LiveWriterError,
    WriterInfo,
    WriterLock,
    is_live,
    live_writers,
    lock_paths,
)


def test_lock_paths_cover_the_run_dir_and_a_local_store_root(tmp_path: Path) -> None:
    paths = lock_paths(tmp_path / "run", str(tmp_path / "store"), "r1")
    assert paths == [tmp_path / "run" / LOCK_NAME, tmp_path / "store" / WRITERS_DIR / "r1.lock"]
    assert lock_paths(tmp_path / "run", "s3://bucket/tables", "r1") == [tmp_path / "run" / LOCK_NAME]


def test_acquire_heartbeat_release(tmp_path: Path) -> None:
    lock = WriterLock(lock_paths(tmp_path, str(tmp_path / "tables"), "r1"), "r1", heartbeat_s=0.05).acquire()
    try:
        writers = live_writers(tmp_path, str(tmp_path / "tables"))
        assert [(w.run_id, w.pid) for w in writers] == [("r1", os.getpid())] * 2
        first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat_at"]
        deadline = time.monotonic() + 10
        while json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat_at"] == first:
            assert time.monotonic() < deadline, "heartbeat never refreshed"
            time.sleep(0.02)
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / "tables" / WRITERS_DIR / "r1.lock").exists()
    assert live_writers(tmp_path, str(tmp_path / "tables")) == []


@contextmanager
def held_elsewhere(lock: Path, run_id: str) -> Iterator[subprocess.Popen]:
    """Another process holding ``lock`` for ``run_id`` until the block ends, then killed (SIGKILL)."""
    code = ("import sys, time; from pathlib import Path; from reflow.infra.runlock import WriterLock; "
            f"WriterLock([Path({str(lock)!r})], {run_id!r}).acquire(); print('ok', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ok"
        yield proc
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_lock_of_a_killed_process_is_not_live(tmp_path: Path) -> None:
    with held_elsewhere(tmp_path / LOCK_NAME, "r2") as proc:
        assert [w.pid for w in live_writers(tmp_path, None)] == [proc.pid]
    assert (tmp_path / LOCK_NAME).exists()  # left behind by the killed process
    assert live_writers(tmp_path, None) == []


def test_a_live_writer_is_refused_and_its_lock_left_alone(tmp_path: Path, capsys) -> None:
    """A run resumed while it still runs: the second writer is refused, the first keeps its lock; once that
    process is gone, its stale lock is taken over."""
    from reflow.cli.main import main

    run = tmp_path / "runs" / "r3"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "run.json").write_text(json.dumps({"run_id": "r3"}))
    with held_elsewhere(run / LOCK_NAME, "r3") as proc:
        held = (run / LOCK_NAME).read_text()
        with pytest.raises(LiveWriterError, match=rf"(?s)run r3 is still running.*pid {proc.pid}"):
            WriterLock([tmp_path / "store.lock", run / LOCK_NAME], "r3").acquire()
        assert (run / LOCK_NAME).read_text() == held and not (tmp_path / "store.lock").exists()
        assert main(["resume", "r3", "--runs", str(tmp_path / "runs")]) == 2  # before Ray, Prefect or a worker
        assert "is still running; wait for it to finish, or stop it first" in (err := capsys.readouterr().err)
        assert f"\n  run r3 (pid {proc.pid}" in err
    lock = WriterLock([run / LOCK_NAME], "r3").acquire()
    lock.release()
    assert not (run / LOCK_NAME).exists()


def test_other_host_lock_is_live_while_its_heartbeat_is_fresh() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    info = WriterInfo(path="x", run_id="r", pid=1, host="elsewhere.invalid", started_at=now.isoformat(),
                      heartbeat_at=now.isoformat())
    assert is_live(info, now + dt.timedelta(seconds=30))
    assert not is_live(info, now + dt.timedelta(seconds=120))


def test_unreadable_lock_is_ignored(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("{not json")
    assert live_writers(tmp_path, None) == []
