"""The streaming selector's background logging keeps order and does not swallow errors."""

from __future__ import annotations

import threading
import time

import pytest

from reflow.tasks import lifecycle


def test_steps_are_logged_in_order_off_the_calling_thread(monkeypatch) -> None:
    seen: list[tuple[int, str]] = []

    def slow_track(run_dir: str, record: int) -> None:
        time.sleep(0.01 * (5 - record))  # earlier steps take longer: order must still hold
        seen.append((record, threading.current_thread().name))

    monkeypatch.setattr(lifecycle, "log_step", slow_track)
    queue = lifecycle.TrackQueue()
    for step in range(5):
        queue.submit("run", step)  # type: ignore[arg-type]
    queue.drain()
    queue.close()
    assert [s for s, _ in seen] == [0, 1, 2, 3, 4]
    assert all(name.startswith("track") for _, name in seen)


def test_a_failed_log_surfaces_at_the_next_submit_or_drain(monkeypatch) -> None:
    after_failure = threading.Event()  # set by the log after the failed one: the failure is then complete

    def failing_track(run_dir: str, record: int) -> None:
        if record == 1:
            raise OSError("disk full")
        if record == 2:
            after_failure.set()

    monkeypatch.setattr(lifecycle, "log_step", failing_track)
    queue = lifecycle.TrackQueue()
    queue.submit("run", 0)  # type: ignore[arg-type]
    queue.submit("run", 1)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="disk full"):
        queue.drain()
    queue.submit("run", 1)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="disk full"):
        # one worker, in order: once log 2 runs, log 1 has failed, and the next submit reports it (this one
        # may already, if log 1 failed first)
        queue.submit("run", 2)  # type: ignore[arg-type]
        assert after_failure.wait(30)
        queue.submit("run", 3)  # type: ignore[arg-type]
    queue.close()
