"""The control plane of the streaming modes: a feeder loop, a selector loop, and their controllers.

``async`` and ``reflow`` run two loops at once over one shared ``LoopState``:

* **Feeder** (generators -> score -> buffer): keeps the engine filled with
  whole GRPO groups up to the concurrency target, steps it in short drain
  windows, and appends each group to the ``trajectories`` table as soon as
  all its samples are finished. Scoring and writing the previous window
  overlap the engine's next window.
* **Selector** (buffer -> batch -> trainer -> weights -> generators): asks the
  buffer for a batch (one SQL query, ``storage.replay.select_batch``), trains
  on it, and pushes the new weights to the engine without waiting: the
  engine applies them between two drain windows, so the feeder stops only for
  the load itself, and requests in flight continue with the new weights
  (every token keeps the version that sampled it).

Back-pressure (``StalenessGate``): the feeder keeps at most
``max(max_staleness_versions, 1) * groups_per_step`` groups *ahead* of the
trainer (and at least one full batch): in flight, or written and not yet
trained on while still young enough to be admissible. This is AReaL's rule
for ``max_head_offpolicyness`` (``submitted <= (trainer_version +
max_staleness_versions + 1) * groups_per_step``) with one version of slack:
a group's version is its oldest token's, and the engine loads new weights a
moment after the trainer makes them, so a group admitted at trainer version
``t`` may start at ``t - 1``; without the slack a steady share of groups
would age out unused. Counting only admissible groups also covers groups
that do age out (they would otherwise hold the gate shut forever), and the
one-batch floor means a closed gate with nothing in flight always leaves a
full batch of unused groups waiting (no deadlock). The bound itself is
enforced by the selection query, which never returns a row older than
``trainer_version - max_staleness_versions``.

Selection rule per mode (``SelectorLoop.batch_ready``):

* ``async``: a full batch of ``groups_per_step`` unused groups (no replay);
  the trainer waits for them otherwise.
* ``reflow``: a full batch in which replayed groups fill what fresh data
  lacks, up to ``replay_ratio`` of the samples; so the trainer waits only
  while fresh data is below ``1 - replay_ratio`` of a batch. The first batch
  of a run, with nothing yet to replay, is that minimum share of unused
  groups alone.

The selector itself lives in ``infra.selector``. The loops are plain Python
against two small backends and a ``Clock``; the Prefect flow provides
backends made of tasks and Ray actors, the tests provide in-process ones and
drive ``run_once``/``try_step`` in any order.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from reflow.infra.clock import Clock


# --- shared state -----------------------------------------------------------------------------------

@dataclass
class LoopState:
    """What the two loops share (guarded by ``cond``)."""

    trainer_version: int = 0
    groups_submitted: int = 0  # whole groups handed to the engine
    groups_written: int = 0  # whole groups appended to the trajectories table
    groups_consumed: int = 0  # unused (fresh or stale) groups trained on
    groups_expired: int = 0  # written groups that aged out of the window unused (wasted generation)
    groups_abandoned: int = 0  # groups aborted in flight: a finished sample was already out of the window
    unused: dict[int, int] = field(default_factory=dict)  # written, not trained on: group -> oldest version
    engine_busy_s: float = 0.0  # engine time spent stepping with requests in flight
    generated_tokens: int = 0
    stop: bool = False
    error: BaseException | None = None  # why a loop stopped the run
    cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def set_version(self, version: int) -> None:
        with self.cond:
            self.trainer_version = version
            self.cond.notify_all()

    def admissible_unused(self, max_staleness_versions: int) -> int:
        """Unused groups still inside the window (call with ``cond`` held); expired ones are dropped."""
        oldest_ok = self.trainer_version - max_staleness_versions
        expired = [g for g, v in self.unused.items() if v < oldest_ok]
        for g in expired:
            del self.unused[g]
        self.groups_expired += len(expired)
        return len(self.unused)

    def request_stop(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


# --- back-pressure and concurrency ----------------------------------------------------------------------

@dataclass(frozen=True)
class StalenessGate:
    """How many more groups the feeder may submit (see the module docstring)."""

    max_staleness_versions: int
    groups_per_step: int  # unused groups one trainer step consumes
    batch_groups: int  # groups in one full batch

    @property
    def cap(self) -> int:
        """Most groups ahead of the trainer: ``max(max(S, 1) * groups_per_step, batch_groups)``."""
        return max(max(self.max_staleness_versions, 1) * self.groups_per_step, self.batch_groups)

    def allowed(self, ahead: int) -> int:
        """``cap - ahead``, at least 0; ``ahead``: groups in flight plus admissible unused ones."""
        return max(0, self.cap - ahead)


class ConcurrencyController:
    """Additive-increase / multiplicative-decrease on measured generation throughput, judging moves only.

    A window is at least ``window_s`` engine-busy seconds in which the engine
    ran at its target (a window limited by the gate says nothing about
    concurrency and is discarded). A move of the target is judged by the
    first window after it, against the mean throughput of the windows at the
    target before it:

    * after a move up: at least ``1 + tolerance`` times that mean, the move
      helped, so ``target += increase`` again; below ``1 - tolerance``
      times, back off: ``target = max(minimum, floor(target * decrease))``
      (longer responses made each step slower than the extra sequences are
      worth, or memory pressure preempts requests); otherwise hold;
    * after a back-off: below ``1 - tolerance`` times, the back-off hurt, so
      ``target += increase``; otherwise hold.

    Windows at an unchanged target judge nothing: they only measure it. Its
    throughput moves with things the target does not cause (the responses
    in flight, weight loads, other processes on the cores), and a rule that
    compared each window with the one before backed off on that noise: in a
    2026-12-02 bench run the reflow engine (more weight loads) averaged 108
    sequences and async's 147, where more sequences always decode faster on
    that CPU. After ``patience`` windows at one target the controller probes
    upward (response lengths drift during RL, so the best setting moves);
    the first window of a run is such a probe. ``target`` stays in
    ``[minimum, maximum]``. Every decision is kept so the caller can log it.
    """

    def __init__(self, initial: int, minimum: int, maximum: int, increase: int, decrease: float = 0.75,
                 tolerance: float = 0.05, window_s: float = 2.0, patience: int = 3) -> None:
        if not 1 <= minimum <= initial <= maximum:
            raise ValueError(f"need 1 <= minimum ({minimum}) <= initial ({initial}) <= maximum ({maximum})")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {decrease}")
        self.target, self.minimum, self.maximum = initial, minimum, maximum
        self.increase, self.decrease, self.tolerance = increase, decrease, tolerance
        self.window_s, self.patience = window_s, patience
        self._tokens = 0
        self._seconds = 0.0
        self._saturated = True
        self._level: list[float] = []  # throughput of the windows at the current target
        self._judge: tuple[float, int] | None = None  # (mean throughput before the last move, its direction)
        self._started = False
        self.decisions: list[tuple[int, float, str]] = []  # (target after, throughput, reason)

    def observe(self, tokens: int, busy_s: float, saturated: bool) -> int:
        """Account one drain window; returns the (possibly new) target."""
        self._tokens += tokens
        self._seconds += busy_s
        self._saturated &= saturated
        if self._seconds < self.window_s:
            return self.target
        throughput = self._tokens / self._seconds
        usable = self._saturated
        self._tokens, self._seconds, self._saturated = 0, 0.0, True
        if not usable:
            return self.target
        reason = self._decide(throughput)
        before = sum(self._level) / len(self._level) if self._level else throughput
        moved = self.target
        if reason in ("increase", "probe"):
            self.target = min(self.maximum, self.target + self.increase)
        elif reason == "decrease":
            self.target = max(self.minimum, int(math.floor(self.target * self.decrease)))
        if self.target != moved:
            self._judge, self._level = (before, 1 if self.target > moved else -1), []
        elif reason == "probe":  # at the maximum: nothing to probe, measure afresh
            self._level = []
        self.decisions.append((self.target, throughput, reason))
        return self.target

    def _decide(self, throughput: float) -> str:
        """The reason of this window's decision; records the window at the target it measured."""
        judge, self._judge = self._judge, None
        self._level.append(throughput)
        if not self._started:
            self._started = True
            return "probe"
        if judge is None:  # an unchanged target: measured, not judged
            return "probe" if len(self._level) >= self.patience else "hold"
        before, direction = judge
        if direction > 0 and throughput >= before * (1 + self.tolerance):
            return "increase"
        if throughput < before * (1 - self.tolerance):
            return "decrease" if direction > 0 else "increase"
        return "hold"


# --- feeder -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finished:
    """A finished sample as the feeder sees it: its group index and the engine's result."""

    group: int
    result: Any  # policies.engines.GenResult
    tokens: int


@dataclass(frozen=True)
class Drained:
    """What one drain window returned."""

    finished: list[Finished]
    busy_s: float  # engine time spent stepping
    in_flight: int  # requests still running after the window


class FeederBackend(Protocol):
    """What the feeder drives: an engine that takes whole groups, and the buffer's writer."""

    samples_per_group: int

    def submit(self, groups: Sequence[int]) -> None:
        """Hand the engine ``samples_per_group`` requests for each group index (prompt ``g`` of the stream)."""
        ...

    def start_drain(self, window_s: float) -> Any:
        """Start stepping the engine for about ``window_s``; returns a handle."""
        ...

    def wait_drain(self, handle: Any) -> Drained: ...

    def write(self, chunk: int, groups: dict[int, list[Finished]]) -> None:
        """Score whole groups and append them to the buffer as chunk ``chunk`` (idempotent per chunk)."""
        ...

    def abandon(self, groups: Sequence[int]) -> None:
        """Abort the requests of ``groups`` still in flight, without waiting; their results are not needed."""
        ...


class FeederLoop:
    """Generators -> score -> buffer, with the staleness gate and adaptive concurrency."""

    def __init__(self, backend: FeederBackend, state: LoopState, gate: StalenessGate,
                 controller: ConcurrencyController, clock: Clock, window_s: float = 0.25,
                 idle_poll_s: float = 0.02, max_groups: int | None = None, write_min_groups: int = 1,
                 write_max_wait_s: float = 1.0, batch_unused_groups: int = 0) -> None:
        self.backend, self.state, self.gate, self.controller, self.clock = backend, state, gate, controller, clock
        self.window_s, self.idle_poll_s, self.max_groups = window_s, idle_poll_s, max_groups
        # Fewer, larger appends: a Delta commit per window would leave thousands of small files.
        self.write_min_groups, self.write_max_wait_s = write_min_groups, write_max_wait_s
        self.batch_unused_groups = batch_unused_groups  # the selector's minimum of unused groups per batch
        self._last_write = clock.now()
        self._next_group = 0
        self._in_flight = 0  # requests
        self._partial: dict[int, list[Finished]] = {}
        self._complete: dict[int, list[Finished]] = {}
        self._abandoned: set[int] = set()  # groups given up while in flight (results still arriving are dropped)
        self._handle: Any = None
        self._chunk = 0
        self._written = 0  # groups written

    def resume_at(self, next_group: int, next_chunk: int) -> None:
        """Continue a resumed run's stream: groups from ``next_group``, writes as chunks from ``next_chunk``.

        Groups a killed attempt had in flight were never written; they are skipped, not re-generated.
        """
        self._next_group = self._written = next_group
        self._chunk = next_chunk

    def _admit(self) -> None:
        """Submit as many whole groups as the gate and the concurrency target allow."""
        with self.state.cond:
            ahead = self.in_flight_groups + self.state.admissible_unused(self.gate.max_staleness_versions)
            allowed = self.gate.allowed(ahead)
        room = (self.controller.target - self._in_flight) // self.backend.samples_per_group
        n = min(allowed, room)
        if self.max_groups is not None:
            n = min(n, self.max_groups - self._next_group)
        if n <= 0:
            return
        groups = list(range(self._next_group, self._next_group + n))
        self.backend.submit(groups)
        self._next_group += n
        self._in_flight += n * self.backend.samples_per_group
        with self.state.cond:
            self.state.groups_submitted += n

    @property
    def in_flight_groups(self) -> int:
        """Groups submitted and neither written nor abandoned."""
        return self._next_group - self._written - len(self._abandoned)

    def _abandon_expired(self) -> None:
        """Give up groups that can no longer be trained on, and free their slots in the engine.

        A group's version is its oldest token's, so once a finished sample is
        older than the staleness window the group never will be admissible;
        finishing its other samples would only cost generation.
        """
        with self.state.cond:
            oldest_ok = self.state.trainer_version - self.gate.max_staleness_versions
        hopeless = [g for g, items in self._partial.items() if min(i.result.version for i in items) < oldest_ok]
        if not hopeless:
            return
        self.backend.abandon(hopeless)
        for g in hopeless:
            self._in_flight -= self.backend.samples_per_group - len(self._partial.pop(g))
            self._abandoned.add(g)
        with self.state.cond:
            self.state.groups_abandoned += len(hopeless)

    def _flush(self, force: bool = False) -> None:
        """Write the groups completed so far (while the engine runs the next window).

        Waits for ``write_min_groups`` complete groups, or ``write_max_wait_s``
        since the last write, unless ``force`` or the selector is waiting for
        them: fewer than ``batch_unused_groups`` unused groups are written,
        and these make up the difference (the trainer would otherwise wait
        for the batching; at most one such small write per step).
        """
        if not self._complete:
            return
        waited = self.clock.now() - self._last_write
        with self.state.cond:
            unused = len(self.state.unused)
        needed = unused < self.batch_unused_groups <= unused + len(self._complete)
        if not force and not needed and len(self._complete) < self.write_min_groups \
                and waited < self.write_max_wait_s:
            return
        self._last_write = self.clock.now()
        groups, self._complete = self._complete, {}
        self.backend.write(self._chunk, groups)
        self._chunk += 1
        self._written += len(groups)
        with self.state.cond:
            self.state.groups_written += len(groups)
            for g, items in groups.items():
                self.state.unused[g] = min(item.result.version for item in items)
            self.state.cond.notify_all()

    def run_once(self) -> bool:
        """One window: collect the last drain, admit groups, start the next drain, write finished groups.

        Returns False when there is nothing to do (nothing in flight and the
        gate closed); the caller then waits.
        """
        if self._handle is not None:
            drained = self.backend.wait_drain(self._handle)
            self._handle = None
            tokens = finished = 0
            for item in drained.finished:
                tokens += item.tokens
                if item.group in self._abandoned:  # finished before its abort reached the engine
                    continue
                finished += 1
                self._partial.setdefault(item.group, []).append(item)
                if len(self._partial[item.group]) == self.backend.samples_per_group:
                    self._complete[item.group] = self._partial.pop(item.group)
            # Admission is in whole groups, so a full engine sits up to one group below the target.
            saturated = self._in_flight + self.backend.samples_per_group > self.controller.target
            self._in_flight -= finished
            with self.state.cond:
                self.state.engine_busy_s += drained.busy_s
                self.state.generated_tokens += tokens
            self.controller.observe(tokens, drained.busy_s, saturated)
            self._abandon_expired()
        self._admit()
        if self._in_flight > 0:
            self._handle = self.backend.start_drain(self.window_s)
        self._flush()
        return self._handle is not None

    def run(self) -> None:
        """Until ``state.stop``: run windows; wait on the state while the gate holds generation back.

        An exception stops both loops (``state.error`` keeps it for the caller).
        """
        try:
            self._run()
        except BaseException as exc:
            with self.state.cond:
                self.state.error = exc
            self.state.request_stop()

    def _run(self) -> None:
        while True:
            with self.state.cond:
                if self.state.stop:
                    break
            if not self.run_once():
                with self.state.cond:
                    if not self.state.stop:
                        self.state.cond.wait(timeout=self.idle_poll_s)
        if self._handle is not None:  # let the engine finish its window; results are dropped with the run
            self.backend.wait_drain(self._handle)
            self._handle = None
        self._flush(force=True)
