"""The stage-speed scheduler: which role each flex worker plays, decided from measured stage speeds.

A flex worker holds the model once and either generates (an engine) or
trains (a data-parallel member of the trainer). The scheduler looks at the
buffer between the two stages: the admissible unused groups, in batches.
When that level falls, generation is slower than training and the trainer
will soon wait; when it rises, training is the slower stage and the
engines' work will age out. Each window it reads the measured rates and
moves at most one worker towards the slow stage:

* **Band with hysteresis.** Below ``low`` batches and still falling
  (groups trained per second above groups produced), one trainer-side flex
  worker moves to generation; above ``high`` and still rising, one
  generating worker moves to training. Inside the band nothing moves, and
  a level outside it that is already heading back moves nothing either.
* **Minimum dwell.** A worker stays at least ``dwell_s`` in a role, and
  the pool switches at most once per ``dwell_s``: rates measured over a
  window are noisy, and a switch costs ``switch_s`` of the worker's time.
* **A switch must pay for itself.** The faster stage waits for the slower
  one ``|produced - trained| / max(produced, trained)`` of the time; over
  the next dwell that waiting, the most a switch can win back, must exceed
  the switch's measured cost.

Every decision keeps its reason and the rates it used, for the tracker
(``role_generators``, ``role_trainers``, ``role_switches``,
``switch_seconds``). Plain Python against a clock, like the other
controllers, so the simulator can run it in virtual time. Nothing calls it
yet: the flex workers it moves are not built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from reflow.control.clock import Clock

Role = Literal["generate", "train"]


@dataclass(frozen=True)
class StageRates:
    """What one window measured."""

    produced_groups_per_s: float  # whole groups written to the buffer
    trained_groups_per_s: float  # unused groups the trainer consumed
    buffer_groups: int  # admissible unused groups now
    batch_groups: int  # groups in one batch
    switch_s: float  # the measured cost of one switch (the last ones', or an estimate)


@dataclass(frozen=True)
class RoleDecision:
    at: float
    worker: int | None  # the worker that switches (None: no switch)
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
    decisions: list[RoleDecision] = field(default_factory=list)
    switches: int = 0
    _since: list[float] = field(default_factory=list)  # when each worker took its role
    _last_switch: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"need 0 <= low ({self.low}) < high ({self.high})")
        if self.dwell_s <= 0:
            raise ValueError(f"dwell_s must be > 0, got {self.dwell_s}")
        self._since = [self.clock.now()] * len(self.roles)

    @property
    def generators(self) -> int:
        return sum(r == "generate" for r in self.roles)

    @property
    def trainers(self) -> int:
        return sum(r == "train" for r in self.roles)

    def decide(self, rates: StageRates) -> RoleDecision:
        """One window: at most one switch towards the slow stage; the decision is kept and returned."""
        now = self.clock.now()
        level = rates.buffer_groups / max(rates.batch_groups, 1)
        net = rates.produced_groups_per_s - rates.trained_groups_per_s  # the level's trend, groups per second
        want: Role | None = None
        if level < self.low and net < 0:
            want, reason = "generate", f"buffer {level:.2f} batches < {self.low} and falling ({net:+.3f} groups/s)"
        elif level > self.high and net > 0:
            want, reason = "train", f"buffer {level:.2f} batches > {self.high} and rising ({net:+.3f} groups/s)"
        else:
            reason = f"buffer {level:.2f} batches, trend {net:+.3f} groups/s: hold"
        worker = None
        if want is not None:
            worker, reason = self._pick(want, now, rates, net, reason)
        if worker is not None:
            self.roles[worker] = want
            self._since[worker] = self._last_switch = now
            self.switches += 1
        decision = RoleDecision(now, worker, want if worker is not None else None, reason, rates)
        self.decisions.append(decision)
        return decision

    def _pick(self, want: Role, now: float, rates: StageRates, net: float, reason: str) -> tuple[int | None, str]:
        if self._last_switch is not None and now - self._last_switch < self.dwell_s:
            return None, reason + f"; last switch {now - self._last_switch:.1f} s ago < dwell {self.dwell_s} s"
        movable = [i for i, r in enumerate(self.roles) if r != want and now - self._since[i] >= self.dwell_s]
        if not movable:
            return None, reason + f"; no worker free to move to {want}"
        # the fast stage waits for the slow one this share of the time; over the next dwell that is what a
        # switch can win back at most
        gain_s = self.dwell_s * abs(net) / max(rates.produced_groups_per_s, rates.trained_groups_per_s, 1e-9)
        if gain_s <= rates.switch_s:
            return None, reason + f"; gain {gain_s:.1f} s over a dwell <= switch cost {rates.switch_s:.1f} s"
        return movable[0], reason + f"; worker {movable[0]} -> {want}"
