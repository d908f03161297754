"""The selector loop of the streaming modes: buffer -> batch -> trainer -> weights -> generators.

It asks the buffer for a batch (one SQL query, ``storage.replay.select_batch``,
through its backend), trains on it, and pushes the new weights to the engines
without waiting; with ``buffer.select_ahead`` it chooses the next batch while
the trainer computes. ``control.streaming`` describes how it runs beside the
feeder.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from reflow.control.clock import Clock
from reflow.control.roles import RolePool
from reflow.control.state import LoopState


@dataclass(frozen=True)
class StepOutcome:
    """What the selector loop learns from one trainer step."""

    version: int  # trainer version after the step
    groups: int
    consumed: tuple[int, ...]  # stream positions of the unused (fresh or stale) groups trained on

    @property
    def fresh_groups(self) -> int:
        return len(self.consumed)


class SelectorBackend(Protocol):
    """What the selector drives: the buffer's query, the trainer, the weight push."""

    def select(self, step: int, trainer_version: int) -> Any:
        """A ``storage.replay.ReplaySelection`` (possibly short or empty) for a trainer at ``trainer_version``."""
        ...

    def consumed(self, selection: Any) -> tuple[int, ...]:
        """Stream positions of the unused (fresh or stale) groups in ``selection``."""
        ...

    def prefetch(self, selection: Any) -> None:
        """Have the trainer read ``selection`` while it computes the step before; returns at once."""
        ...

    def start_train(self, step: int, selection: Any) -> Any:
        """Start the trainer on ``selection`` and log it as step ``step``; returns a handle at once."""
        ...

    def finish_train(self, handle: Any, timeout: float | None) -> StepOutcome | None:
        """The step's outcome; None if the trainer is still computing after ``timeout`` seconds (None: wait)."""
        ...

    def push_weights(self, version: int) -> None:
        """Send the weights of ``version`` (taken when its step finished) to the engines without waiting."""
        ...

    def record(self, step: int) -> None:
        """Log step ``step`` (metrics, eval snapshot, checkpoint); called once its weights are on their way."""
        ...

    def uses_trainer(self, step: int) -> bool:
        """Whether recording ``step`` calls the trainer (a checkpoint): the next step then starts after it."""
        ...


@dataclass
class _Training:
    """The trainer step under way (``select_ahead``)."""

    step: int
    handle: Any
    started: float


class SelectorLoop:
    """Buffer -> batch -> trainer -> new weights -> generators.

    Plain (``select_ahead=False``, ``try_step``): select, train, push, record,
    then select again; the trainer waits for the query and for the logging.

    ``select_ahead=True`` (reflow): the next step's batch is chosen while the
    trainer computes, for the version the trainer will be at when it starts
    it (its current version plus one), and the step starts the moment the
    trainer is free, its weights pushed and its record logged. The query runs
    late in the step (``lead_s`` plus the last query's time before the
    trainer is expected to finish), so the batch misses only the groups
    written in that lead. The expected finish is the shortest of the last
    ``recent_steps`` steps: step times vary with the batch's lengths (0.6 to
    3.3 s in one bench run), and a query that starts after the trainer is
    done makes it wait for the query, while one that starts early only
    leaves the newest groups to the next batch. With the last step's time,
    the trainer would have waited for the query in 13 to 15 of 26 steps of
    three bench runs; with the shortest of the last four, in 4 to 7.

    A batch chosen ahead is handed to the trainer at once (``prefetch``),
    which reads its rows while it computes, so the read is off its path.

    The next step starts before the finished one's weight push and record
    (the backend took its weights as it finished); a checkpoint, which
    reads the trainer's state, is saved before it.

    ``max_new_groups`` (``run.max_new_groups``; 0: none) ends the run
    early: the step whose batch brings the unused groups trained on to it
    (counting ``new_groups`` trained before this attempt) is the last
    (``final_step``), and no step starts after it.

    ``pool`` (``control.roles.RolePool``): the flex workers' scheduler ticks
    as each step finishes; the backend lends the step the workers ``ready``
    to train when it starts it.
    """

    def __init__(self, backend: SelectorBackend, state: LoopState, groups_per_step: int, clock: Clock,
                 min_unused_groups: int, poll_s: float = 0.5, select_ahead: bool = False,
                 lead_s: float = 0.05, busy_poll_s: float = 0.05, recent_steps: int = 4, max_new_groups: int = 0,
                 new_groups: int = 0, pool: RolePool | None = None) -> None:
        self.pool = pool  # the elastic pool's scheduler: one decision per window, taken as steps finish
        self.backend, self.state, self.groups_per_step, self.clock = backend, state, groups_per_step, clock
        self.min_unused_groups = min_unused_groups  # a batch needs at least this many unused groups
        self.poll_s, self.select_ahead, self.lead_s, self.busy_poll_s = poll_s, select_ahead, lead_s, busy_poll_s
        self.waited_s = 0.0  # time spent waiting for an admissible batch while the trainer had nothing (idle)
        self.training: _Training | None = None
        self.ahead: tuple[int, Any] | None = None  # (step, selection) chosen while the trainer computes
        self.train_s: deque[float] = deque(maxlen=recent_steps)  # the last steps' start-to-finish times
        self.select_s = 0.0  # the last query's time
        self.selected_ahead = 0  # batches chosen while the step before was computing
        self._short: tuple[int, int] | None = None  # (groups written, version) of the last query that came short
        self.max_new_groups, self.new_groups = max_new_groups, new_groups  # the budget; unused groups trained on
        self.final_step: int | None = None  # the step that reached max_new_groups

    def batch_ready(self, selection: Any, trainer_version: int) -> bool:
        """A full batch of whole groups (the replay share is already capped by the query).

        The first batch of a run (``trainer_version`` 0: nothing was trained
        on, so nothing can be replayed) is ready with ``min_unused_groups``,
        the least any later batch holds of unused groups: the trainer starts
        as soon as they are written instead of waiting for a full batch of
        them. With ``replay_ratio`` 0 (async) the minimum is a full batch.
        """
        groups = len(set(selection.group_ids))
        return groups >= self.groups_per_step or (trainer_version == 0 and groups >= self.min_unused_groups)

    def try_step(self, step: int) -> StepOutcome | None:
        """Train step ``step`` if a full batch is admissible now; None otherwise (plain form)."""
        selection = self._select(step)
        if selection is None:
            return None
        self._start(step, selection)
        return self._finish(timeout=None)

    def try_start(self, step: int, block: bool = False) -> bool:
        """``select_ahead`` form: finish the step under way if it is done, choose ``step``'s batch, start it.

        True when ``step`` started. The batch is kept while the step before
        computes; ``block`` waits for that step instead of returning False.
        """
        if self.ahead is None or self.ahead[0] != step:
            if self.training is not None:
                self._finish(timeout=0.0)
            selection = self._select(step)
            if selection is None:
                return False
            self.ahead = (step, selection)
        if self.training is None:
            self._start(*self.ahead)
        elif self._finish(timeout=None if block else 0.0, then=self.ahead) is None:
            return False
        self.ahead = None
        return True

    def _select(self, step: int) -> Any | None:
        if not self._may_be_ready():
            return None
        with self.state.cond:
            inputs = (self.state.groups_written, self.state.trainer_version + (self.training is not None))
        if inputs == self._short:
            return None  # nothing written since the same query came short
        started = self.clock.now()
        selection = self.backend.select(step, inputs[1])
        self.select_s = self.clock.now() - started
        if not self.batch_ready(selection, inputs[1]):
            self._short = inputs
            return None
        if self.training is not None:
            self.selected_ahead += 1
            self.backend.prefetch(selection)  # the trainer reads it while it finishes the step under way
        return selection

    def _start(self, step: int, selection: Any) -> None:
        consumed = self.backend.consumed(selection)
        self.training = _Training(step, self.backend.start_train(step, selection), self.clock.now())
        self.new_groups += len(consumed)
        if self.final_step is None and self._budget_spent():
            self.final_step = step
        with self.state.cond:  # consumed from now on: the feeder may replace them while the step computes
            self.state.groups_consumed += len(consumed)
            for g in consumed:
                self.state.unused.pop(g, None)

    def _finish(self, timeout: float | None, then: tuple[int, Any] | None = None) -> StepOutcome | None:
        """Collect the step under way (new version, weight push, record), and start ``then`` (step, batch).

        ``then`` starts before the push and the record, so the trainer goes
        on at once, unless recording the finished step uses the trainer (a
        checkpoint: it must save exactly that step's state).
        """
        assert self.training is not None
        outcome = self.backend.finish_train(self.training.handle, timeout)
        if outcome is None:
            return None
        step = self.training.step
        self.train_s.append(self.clock.now() - self.training.started)
        self.training = None
        self.state.set_version(outcome.version)
        if self.pool is not None:
            self.pool.tick(self.waited_s)
        early = then is not None and not self.backend.uses_trainer(step)
        if early:
            self._start(*then)
        self.backend.push_weights(outcome.version)
        self.backend.record(step)  # after the push: the engine gets the new weights without waiting for logging
        if then is not None and not early:
            self._start(*then)
        return outcome

    def _may_be_ready(self) -> bool:
        """Cheap pre-check before the query: enough admissible groups written and not yet consumed."""
        with self.state.cond:
            return len(self.state.unused) >= self.min_unused_groups

    def _until_select(self) -> float:
        """Seconds to let the step under way run before choosing the next batch."""
        if self.training is None or not self.train_s:
            return 0.0
        lead = self.lead_s + self.select_s
        return max(0.0, self.training.started + min(self.train_s) - lead - self.clock.now())

    def _budget_spent(self) -> bool:
        return 0 < self.max_new_groups <= self.new_groups

    def run(self, steps: range) -> None:
        """Train every step of ``steps`` (up to the budget); between failed attempts, wait for the feeder."""
        for step in steps:
            if self._budget_spent():
                break
            if self.select_ahead and self.training is not None:
                self._finish(timeout=self._until_select())
            while True:
                with self.state.cond:
                    seen = self.state.groups_written
                started = self.clock.now()
                if self.try_start(step, block=True) if self.select_ahead else self.try_step(step) is not None:
                    break
                if self.training is not None:  # no batch yet: collect the step under way meanwhile
                    self._finish(timeout=self.busy_poll_s)
                    continue
                with self.state.cond:
                    if self.state.stop:
                        return
                    if self.state.groups_written == seen:
                        self.state.cond.wait(timeout=self.poll_s)
                self.waited_s += self.clock.now() - started
        self.finish()

    def finish(self) -> None:
        """Wait for the step under way, if any, and collect it."""
        if self.training is not None:
            self._finish(timeout=None)
