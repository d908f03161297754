"""The writer lock: a running run says so in its run directory and next to its tables.

While a run is alive it holds a small JSON file (pid, host, start and
heartbeat times) at ``<run_dir>/writer.lock`` and, for a local store root,
at ``<store_root>/_writers/<run_id>.lock``. Table maintenance (vacuum) must
not run while a writer is live, so ``live_writers`` tells it who is.

A lock is *live* when its process still exists (same host: ``kill(pid, 0)``)
or, for a lock written on another host, when its heartbeat is younger than
``STALE_AFTER_S``. A lock left behind by a killed process is therefore not
live, and a clean exit removes the files.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "writer.lock"
WRITERS_DIR = "_writers"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


@dataclass(frozen=True)
class WriterInfo:
    """What one lock file says."""

    path: str
    run_id: str
    pid: int
    host: str
    started_at: str
    heartbeat_at: str


def lock_paths(run_dir: str | Path, store_root: str | None, run_id: str) -> list[Path]:
    """Where a run's lock files go: its run directory and, for a local store root, ``_writers/``."""
    paths = [Path(run_dir) / LOCK_NAME]
    if store_root and "://" not in store_root:
        paths.append(Path(store_root) / WRITERS_DIR / f"{run_id}.lock")
    return paths


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


class WriterLock:
    """Held by a running run: writes its lock files and refreshes their heartbeat in a daemon thread."""

    def __init__(self, paths: list[Path], run_id: str, heartbeat_s: float = HEARTBEAT_S) -> None:
        """Nothing is written until ``acquire``."""
        self.paths = paths
        self.run_id = run_id
        self.heartbeat_s = heartbeat_s
        self._started = _now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        body = json.dumps({"run_id": self.run_id, "pid": os.getpid(), "host": socket.gethostname(),
                           "started_at": self._started, "heartbeat_at": _now()})
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_text(body)
            tmp.replace(path)

    def acquire(self) -> "WriterLock":
        """Write the lock files and start the heartbeat; LiveWriterError, writing nothing, if another live
        process holds one of them (a run resumed while it still runs: two writers of one run's tables)."""
        me = (socket.gethostname(), os.getpid())
        held = [i for i in map(read_lock, self.paths) if i is not None and (i.host, i.pid) != me and is_live(i)]
        if held:
            raise LiveWriterError(f"run {self.run_id} is still running; wait for it to finish, or stop it "
                                  "first:\n" + describe_writers(held))
        self._write()
        self._thread = threading.Thread(target=self._beat, name="writer-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write()
            except OSError:  # a full or vanished disk must not kill the run; the pid check still works
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock files (those that are still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for path in self.paths:
            info = read_lock(path)
            if info is not None and info.pid == os.getpid():
                path.unlink(missing_ok=True)


def read_lock(path: Path) -> WriterInfo | None:
    """The lock at ``path``, or None if absent or unreadable (a torn write counts as absent)."""
    try:
        raw = json.loads(path.read_text())
        return WriterInfo(path=str(path), run_id=str(raw["run_id"]), pid=int(raw["pid"]), host=str(raw["host"]),
                          started_at=str(raw["started_at"]), heartbeat_at=str(raw["heartbeat_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_live(info: WriterInfo, now: dt.datetime | None = None) -> bool:
    """Whether the writer of ``info`` is still running (see the module docstring)."""
    if info.host == socket.gethostname():
        return _pid_alive(info.pid)
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        beat = dt.datetime.fromisoformat(info.heartbeat_at)
    except ValueError:
        return False
    return (now - beat).total_seconds() < STALE_AFTER_S


def live_writers(run_dir: str | Path | None, store_root: str | None) -> list[WriterInfo]:
    """Live writer locks of a run directory and of a (local) store root."""
    candidates: list[Path] = []
    if run_dir is not None:
        candidates.append(Path(run_dir) / LOCK_NAME)
    if store_root and "://" not in store_root:
        writers = Path(store_root) / WRITERS_DIR
        if writers.is_dir():
            candidates.extend(sorted(writers.glob("*.lock")))
    infos = [read_lock(p) for p in candidates]
    return [i for i in infos if i is not None and is_live(i)]


class LiveWriterError(RuntimeError):
    """A run is writing to the tables: maintenance refuses to vacuum under it, and a second writer of the same
    run (``WriterLock.acquire``) to start."""


def describe_writers(writers: list[WriterInfo]) -> str:
    """One line per live writer: run, pid, host, last heartbeat, lock file."""
    return "\n".join(f"  run {w.run_id} (pid {w.pid} on {w.host}, heartbeat {w.heartbeat_at}) holds {w.path}"
                     for w in writers)
