"""Virtual time for threads that take turns: the simulator's scheduler.

The control plane's loops are written for threads: the feeder runs in one,
the selector in another, and they meet on ``LoopState.cond``. To run them
unchanged in virtual time, ``SimScheduler`` lets exactly one of its threads
run at a time. A thread gives up its turn only where real time would pass:
``sleep``, ``wait_until`` (a modelled engine window or trainer step ending),
or a wait on a ``SimCondition`` (the loops' ``cond.wait(timeout)``). The
scheduler then moves the clock to the earliest wake-up and hands the turn to
that thread. Ties go to the thread that asked first, so a run is a pure
function of its inputs: the same seed gives the same result, whatever the
OS does with the threads.

Why threads and not a discrete-event library (simpy): the loops block
inside plain method calls (``finish_train`` waits for a step, the selector
waits on a condition), deep in code that must not be rewritten as
generators. A thread per loop keeps that code as it runs in a real run;
the scheduler only decides who runs and what time it is.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any


class Deadlock(RuntimeError):
    """Every thread waits with no time-out and nothing can wake one."""


class SimTask:
    """One thread of the simulation: its turn flag and who waits for it to end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.turn = threading.Event()
        self.token = 0  # the wake-up entry that is current; older ones in the heap are stale
        self.done = False
        self.error: BaseException | None = None
        self.joiners: list[SimTask] = []


class SimScheduler:
    """A ``control.clock.Clock`` in virtual time whose threads take turns (module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._heap: list[tuple[float, int, int, SimTask]] = []  # (at, order, token, task)
        self._order = itertools.count()
        self._tasks: dict[int, SimTask] = {}  # thread ident -> task
        self.cpu_s = 0.0  # CPU seconds the simulation's threads used (each its own, time.thread_time)

    # the Clock interface
    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self._block(self._now + max(0.0, seconds))

    def wait_until(self, at: float) -> None:
        """Give up the turn until virtual time ``at`` (at once if it has passed)."""
        self._block(max(at, self._now))

    def condition(self) -> SimCondition:
        return SimCondition(self)

    def run(self, main: Callable[[], Any]) -> Any:
        """Run ``main`` in the calling thread as the simulation's first thread; returns what it returns."""
        me = SimTask("main")
        self._tasks[threading.get_ident()] = me
        start = time.thread_time()
        try:
            return main()
        finally:
            self.cpu_s += time.thread_time() - start
            del self._tasks[threading.get_ident()]

    def spawn(self, body: Callable[[], Any], name: str) -> SimTask:
        """Start ``body`` in a new thread; it gets its first turn at the current virtual time."""
        task = SimTask(name)

        def target() -> None:
            self._tasks[threading.get_ident()] = task
            task.turn.wait()
            task.turn.clear()
            start = time.thread_time()
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - kept for join
                task.error = exc
            finally:
                self.cpu_s += time.thread_time() - start
                task.done = True
                for joiner in task.joiners:
                    self._wake(joiner)
                del self._tasks[threading.get_ident()]
                self._hand_over(None)

        self._wake(task)
        threading.Thread(target=target, name=f"sim-{name}", daemon=True).start()
        return task

    def join(self, task: SimTask) -> None:
        """Wait (in virtual time) until ``task`` has ended; raise what it raised."""
        while not task.done:
            me = self._current()
            task.joiners.append(me)
            self._block(math.inf)
        if task.error is not None:
            raise task.error

    # the turn
    def _current(self) -> SimTask:
        try:
            return self._tasks[threading.get_ident()]
        except KeyError:
            raise RuntimeError("a thread outside the simulation used its clock (start it with spawn or run)") from None

    def _wake(self, task: SimTask, at: float | None = None) -> None:
        """Make ``task``'s next turn at ``at`` (default: now), replacing the wake-up it had."""
        task.token += 1
        heapq.heappush(self._heap, (self._now if at is None else at, next(self._order), task.token, task))

    def _block(self, at: float) -> None:
        me = self._current()
        self._wake(me, at)
        self._hand_over(me)

    def _hand_over(self, me: SimTask | None) -> None:
        """Give the turn to the earliest valid wake-up (``me``: the caller, who waits for its own)."""
        while True:
            if not self._heap:
                if me is None:
                    return  # the last thread ended
                raise Deadlock(f"{me.name}: every simulated thread waits and none can be woken")
            at, _, token, task = heapq.heappop(self._heap)
            if token == task.token and not task.done:
                break
        if math.isinf(at):
            raise Deadlock(f"every simulated thread waits without a time-out (next: {task.name})")
        self._now = max(self._now, at)
        if task is me:
            return
        task.turn.set()
        if me is not None:
            me.turn.wait()
            me.turn.clear()


class SimCondition:
    """``threading.Condition`` for threads of one ``SimScheduler``: only one runs at a time, so the lock is a
    no-op, and ``wait`` gives up the turn until a notify or the time-out (in virtual time)."""

    def __init__(self, scheduler: SimScheduler) -> None:
        self.scheduler = scheduler
        self._waiting: list[SimTask] = []

    def __enter__(self) -> SimCondition:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """True when notified, False at the time-out."""
        me = self.scheduler._current()
        self._waiting.append(me)
        self.scheduler._block(math.inf if timeout is None else self.scheduler.now() + max(0.0, timeout))
        notified = me not in self._waiting
        if not notified:
            self._waiting.remove(me)
        return notified

    def notify_all(self) -> None:
        waiting, self._waiting = self._waiting, []
        for task in waiting:
            self.scheduler._wake(task)

    def notify(self, n: int = 1) -> None:
        waiting, self._waiting = self._waiting[:n], self._waiting[n:]
        for task in waiting:
            self.scheduler._wake(task)
