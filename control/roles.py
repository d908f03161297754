"""The stage-speed scheduler: which role each flex worker plays, decided from measured stage speeds.

A flex worker holds the model once and either generates (an engine) or
trains (a data-parallel member of the trainer). The scheduler looks at the
buffer between the two stages: the admissible unused groups, in batches.
When that level falls, generation is slower than training and the trainer
will soon wait; when it rises, training is the slower stage and the
engines' work will age out. Each window it reads the measured rates and
moves workers towards the slow stage (one, unless ``max_moves`` allows more):

* **Band with hysteresis.** Below ``low`` batches and not rising (groups
  trained per second at or above groups produced: a buffer that sits empty
  is a trainer that waits), one trainer-side flex worker moves to
  generation; above ``high`` and not falling (a level pinned there is the
  staleness gate holding the engines back), one generating worker moves to
  training. Inside the band nothing moves, and a level outside it that is
  already heading back moves nothing either.
* **Minimum dwell.** A worker stays at least ``dwell_s`` in a role, and
  the pool switches at most once per ``dwell_s``: rates measured over a
  window are noisy, and a switch costs ``switch_s`` of the worker's time.
* **A switch must pay for itself.** The faster stage waits for the slower
  one: the share of the window it measurably waited (the trainer for a
  batch, the engines for work), or, where that is less,
  ``|produced - trained| / max(produced, trained)``; over the next dwell
  that waiting, the most a switch can win back, must exceed the switch's
  measured cost.
* **How many.** With ``max_moves`` above 1 (a large pool, where one worker
  per dwell would take many dwells to follow a change), a decision moves
  as many workers as close the measured wait, at most ``max_moves``: if the
  fast stage waited a share ``w`` of the window, the slow stage must run
  ``1 / (1 - w)`` times as fast, so its ``n`` workers (the fixed ones, plus
  the flex workers already in that role) need ``n * w / (1 - w)`` more, each
  assumed as fast as the average of those ``n``. Moving workers out of the
  fast stage slows it too, so this overshoots a little; the band and the
  dwell bound the correction.

``policy="alternate"`` drops the rule: each window past the dwell, the
worker longest in its role takes the other one. It measures what switches
cost (both directions) and tests the switching itself; it is not a way to
run.

Every decision keeps its reason and the rates it used, for the tracker
(``role_generators``, ``role_trainers``, ``role_switches``,
``switch_seconds``). Plain Python against a clock, like the other
controllers, so the simulator can run it in virtual time. ``RolePool`` wires
it to the streaming loops: the selector calls ``tick`` after each step, which
measures the rates over the last window from the loops' state and hands a
switch to the feeder (``control.feeder``: a worker moving to training gets no
new requests, and is ``ready`` once those in flight have finished).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from reflow.control.clock import Clock
from reflow.control.state import LoopState

Role = Literal["generate", "train"]


@dataclass(frozen=True)
class StageRates:
    """What one window measured."""

    produced_groups_per_s: float  # whole groups written to the buffer
    trained_groups_per_s: float  # unused groups the trainer consumed
    buffer_groups: float  # admissible unused groups waiting (RolePool: their mean over the window)
    batch_groups: int  # groups in one batch
    switch_s: float  # the measured cost of one switch (the last ones', or an estimate)
    trainer_wait: float = 0.0  # share of the window the trainer waited for a batch
    generator_wait: float = 0.0  # share of the window the engines had nothing to step (the pool's mean)


@dataclass(frozen=True)
class RoleDecision:
    at: float
    workers: tuple[int, ...]  # the workers that switch (none: no switch)
    role: Role | None
    reason: str
    rates: StageRates


@dataclass
class RoleScheduler:
    """Roles of ``len(roles)`` flex workers (module docstring for the rule)."""

    roles: list[Role]
    clock: Clock
    low: float = 1.0  # batches of admissible unused groups
    high: float = 3.0
    dwell_s: float = 30.0
    policy: Literal["stage_speed", "alternate"] = "stage_speed"
    max_moves: int = 1  # workers one decision may move (module docstring: "How many")
    fixed_generators: int = 1  # the engines that always generate
    fixed_trainers: int = 1  # the trainer ranks that always train
    decisions: list[RoleDecision] = field(default_factory=list)
    switches: int = 0
    _since: list[float] = field(default_factory=list)  # when each worker took its role
    _last_switch: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"need 0 <= low ({self.low}) < high ({self.high})")
        if self.dwell_s <= 0:
            raise ValueError(f"dwell_s must be > 0, got {self.dwell_s}")
        if self.max_moves < 1:
            raise ValueError(f"max_moves must be >= 1, got {self.max_moves}")
        self._since = [self.clock.now()] * len(self.roles)

    @property
    def generators(self) -> int:
        return sum(r == "generate" for r in self.roles)

    @property
    def trainers(self) -> int:
        return sum(r == "train" for r in self.roles)

    def decide(self, rates: StageRates) -> RoleDecision:
        """One window: switches towards the slow stage (at most ``max_moves``); the decision is kept and returned."""
        now = self.clock.now()
        level = rates.buffer_groups / max(rates.batch_groups, 1)
        net = rates.produced_groups_per_s - rates.trained_groups_per_s  # the level's trend, groups per second
        want: Role | None = None
        if self.policy == "alternate":
            return self._alternate(now, rates, level)
        if level < self.low and net <= 0:
            want, reason = "generate", f"buffer {level:.2f} batches < {self.low}, not rising ({net:+.3f} groups/s)"
        elif level > self.high and net >= 0:
            want, reason = "train", f"buffer {level:.2f} batches > {self.high}, not falling ({net:+.3f} groups/s)"
        else:
            reason = f"buffer {level:.2f} batches, trend {net:+.3f} groups/s: hold"
        workers: tuple[int, ...] = ()
        if want is not None:
            workers, reason = self._pick(want, now, rates, net, reason)
        for worker in workers:
            self.roles[worker] = want
            self._since[worker] = self._last_switch = now
            self.switches += 1
        decision = RoleDecision(now, workers, want if workers else None, reason, rates)
        self.decisions.append(decision)
        return decision

    def _alternate(self, now: float, rates: StageRates, level: float) -> RoleDecision:
        worker, reason = None, f"alternate (buffer {level:.2f} batches)"
        if self._last_switch is not None and now - self._last_switch < self.dwell_s:
            reason += f"; last switch {now - self._last_switch:.1f} s ago < dwell {self.dwell_s} s"
        elif self.roles:
            worker = min(range(len(self.roles)), key=lambda i: (self._since[i], i))
        role: Role | None = None
        if worker is not None:
            role = "generate" if self.roles[worker] == "train" else "train"
            self.roles[worker] = role
            self._since[worker] = self._last_switch = now
            self.switches += 1
            reason += f"; worker {worker} -> {role}"
        decision = RoleDecision(now, () if worker is None else (worker,), role, reason, rates)
        self.decisions.append(decision)
        return decision

    def _pick(self, want: Role, now: float, rates: StageRates, net: float,
              reason: str) -> tuple[tuple[int, ...], str]:
        if self._last_switch is not None and now - self._last_switch < self.dwell_s:
            return (), reason + f"; last switch {now - self._last_switch:.1f} s ago < dwell {self.dwell_s} s"
        movable = [i for i, r in enumerate(self.roles) if r != want and now - self._since[i] >= self.dwell_s]
        if not movable:
            return (), reason + f"; no worker free to move to {want}"
        # the fast stage waits for the slow one this share of the time; over the next dwell that is what a
        # switch can win back at most
        waiting = rates.trainer_wait if want == "generate" else rates.generator_wait
        gap = abs(net) / max(rates.produced_groups_per_s, rates.trained_groups_per_s, 1e-9)
        share = max(waiting, gap)
        gain_s = self.dwell_s * share
        if gain_s <= rates.switch_s:
            return (), reason + f"; gain {gain_s:.1f} s over a dwell <= switch cost {rates.switch_s:.1f} s"
        n = 1
        if self.max_moves > 1:  # enough to close the wait ("How many")
            slow = (self.fixed_generators if want == "generate" else self.fixed_trainers) + sum(
                r == want for r in self.roles)
            share = min(share, 0.9)  # a stage that waited (almost) always: at most 9 times its size
            n = max(1, min(self.max_moves, len(movable), math.ceil(slow * share / (1 - share) - 1e-9)))
        chosen = tuple(movable[:n])
        return chosen, reason + f"; worker{'s' if n > 1 else ''} {', '.join(map(str, chosen))} -> {want}"


@dataclass(frozen=True)
class PoolFigures:
    """The pool as one step's metrics report it."""

    generators: int
    trainers: int
    switches: int  # since the run started
    switch_seconds: float | None  # mean of the switches finished since the last report (None: none)
    decision: str  # the last decision's reason


class RolePool:
    """The scheduler over the streaming loops' ``LoopState``.

    ``flex`` are the engine indices of the flex workers (``scheduler.roles[k]``
    is ``flex[k]``'s). ``tick`` decides at most once per ``window_s``: the
    produced rate is whole groups written per second, the trained rate unused
    groups consumed per second, the level the mean of unused groups waiting
    (``LoopState.unused_group_seconds``), all over the window; the switch cost is the mean of the switches measured so
    far, or ``switch_estimate_s`` before the first.
    """

    def __init__(self, scheduler: RoleScheduler, state: LoopState, flex: list[int], batch_groups: int,
                 window_s: float, switch_estimate_s: float) -> None:
        if len(flex) != len(scheduler.roles):
            raise ValueError(f"{len(flex)} flex engines for {len(scheduler.roles)} roles")
        self.scheduler, self.state, self.flex = scheduler, state, list(flex)
        self.batch_groups, self.window_s, self.switch_estimate_s = batch_groups, window_s, switch_estimate_s
        # (when, groups written, groups consumed, trainer waited, engine busy, unused group-seconds) at the
        # window's start
        self._last: tuple[float, int, int, float, float, float] | None = None
        self._reported = 0  # switch_seconds already reported
        with state.cond:
            for engine, role in zip(self.flex, scheduler.roles):
                state.roles[engine] = role
                if role == "train":
                    state.ready.add(engine)

    def tick(self, trainer_waited_s: float = 0.0) -> RoleDecision | None:
        """One decision if a window has passed since the last (the first call only starts the window).

        ``trainer_waited_s``: the selector's running total of seconds the trainer waited for a batch.
        """
        now = self.scheduler.clock.now()
        with self.state.cond:
            written, consumed, area = (self.state.groups_written, self.state.groups_consumed,
                                       self.state.unused_group_seconds)
            busy = self.state.engine_busy_s
            measured = [seconds for _, _, seconds in self.state.switch_seconds]
        mark = (now, written, consumed, trainer_waited_s, busy, area)
        if self._last is None:
            self._last = mark
            return None
        since, written0, consumed0, waited0, busy0, area0 = self._last
        if now - since < self.window_s:
            return None
        self._last = mark
        dt = now - since
        switch_s = sum(measured) / len(measured) if measured else self.switch_estimate_s
        level = (area - area0) / dt  # the window's mean level of unused groups
        decision = self.scheduler.decide(StageRates(
            (written - written0) / dt, (consumed - consumed0) / dt, level, self.batch_groups, switch_s,
            trainer_wait=min(1.0, (trainer_waited_s - waited0) / dt),
            generator_wait=min(1.0, max(0.0, 1.0 - (busy - busy0) / dt))))
        if decision.workers and decision.role is not None:
            with self.state.cond:
                for worker in decision.workers:
                    engine = self.flex[worker]
                    self.state.roles[engine] = decision.role
                    self.state.switching[engine] = now
                    self.state.ready.discard(engine)  # moving to generate: no step may take it any more
                self.state.cond.notify_all()
        return decision

    def ready(self) -> list[int]:
        """Engine indices of the flex workers a step may use now (set to train, nothing in flight)."""
        with self.state.cond:
            return sorted(self.state.ready)

    def finished_switches(self) -> list[tuple[int, str, float]]:
        """The switches finished since the last call: (engine index, new role, seconds)."""
        with self.state.cond:
            new = self.state.switch_seconds[self._reported:]
            self._reported = len(self.state.switch_seconds)
        return new

    def figures(self, finished: list[tuple[int, str, float]]) -> PoolFigures:
        """The pool's figures, with ``finished`` (``finished_switches``) for the switch time."""
        new = [seconds for _, _, seconds in finished]
        last = self.scheduler.decisions[-1].reason if self.scheduler.decisions else "no decision yet"
        return PoolFigures(generators=self.scheduler.generators, trainers=self.scheduler.trainers,
                           switches=self.scheduler.switches, switch_seconds=sum(new) / len(new) if new else None,
                           decision=last)
