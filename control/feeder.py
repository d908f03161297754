"""The feeder loop of the streaming modes: generators -> score -> buffer.

It keeps the engines filled with whole GRPO groups up to the concurrency
target (``control.concurrency``: one controller per engine, each judging its
own engine's windows, so a slower or busier engine, such as a flex worker,
gets its own target) and the staleness gate (``control.gate``),
steps them in short drain windows, and appends each group to the
``trajectories`` table as soon as all its samples are finished. Scoring and
writing the previous window overlap the engine's next window. A group whose
finished sample has aged out of the staleness window is abandoned in flight
(the lengths of its samples that finished are kept: ``FeederBackend.gave_up``).
``control.streaming`` describes how it runs beside the selector.

A flex worker the role scheduler (``control.roles``) moves to training gets
no new group; with ``move_on_switch`` its engine also gives back the
requests it runs (``release``), and the feeder deals each one, with what it
had generated (every token keeps its log-prob and version), to the
generating engine with the most room, where it resumes by prefill as after
a weight update. Without it they finish where they run first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from reflow.control.clock import Clock
from reflow.control.concurrency import ConcurrencyController
from reflow.control.gate import StalenessGate
from reflow.control.state import GroupVersions, LoopState


@dataclass(frozen=True)
class Finished:
    """A finished sample as the feeder sees it: its group index and the engine's result."""

    group: int
    result: Any  # policies.engines.GenResult
    tokens: int  # what engine ``engine`` generated of it (a moved request's earlier tokens are its first engine's)
    engine: int = 0  # index of the engine that finished it


@dataclass(frozen=True)
class Released:
    """A request an engine gave back before it finished: its group, its engine, and the request that resumes it
    elsewhere (a ``GenRequest`` carrying what was generated so far)."""

    group: int
    request: Any
    engine: int
    tokens: int = 0  # what engine ``engine`` generated of it before giving it back


@dataclass(frozen=True)
class Drained:
    """What one drain window returned."""

    finished: list[Finished]
    busy_s: float  # engine time spent stepping (the pool's: averaged over its engines)
    in_flight: int  # requests still running after the window
    # engine index -> its own stepping seconds, for the engines whose window ended here (None: engine 0 alone,
    # busy_s seconds)
    busy_by_engine: dict[int, float] | None = None
    released: list[Released] = field(default_factory=list)  # requests given back (``FeederBackend.release``)

    def engine_busy(self) -> dict[int, float]:
        """Engine index -> stepping seconds of this window."""
        return self.busy_by_engine if self.busy_by_engine is not None else {0: self.busy_s}


class FeederBackend(Protocol):
    """What the feeder drives: an engine that takes whole groups, and the buffer's writer."""

    samples_per_group: int

    def submit(self, groups: Sequence[int], engine: int = 0) -> None:
        """Hand engine ``engine`` ``samples_per_group`` requests for each group index (prompt ``g`` of the
        stream)."""
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

    def gave_up(self, finished: dict[int, list[Finished]]) -> None:
        """Keep a record of the samples that had finished of groups given up in flight (group -> samples): when
        they are given up, and again for a sample that finishes after its group was (their lengths are part
        of the workload a run generated: ``bench.sim_calibrate.bench_traces``)."""
        ...

    def release(self, engine: int) -> None:
        """Have engine ``engine`` give back the requests it runs at its next window (``Drained.released``)."""
        ...

    def resubmit(self, requests: Sequence[Any], engine: int) -> None:
        """Hand engine ``engine`` requests another engine gave back (``Released.request``)."""
        ...


class FeederLoop:
    """Generators -> score -> buffer, with the staleness gate and adaptive concurrency."""

    def __init__(self, backend: FeederBackend, state: LoopState, gate: StalenessGate,
                 controllers: Sequence[ConcurrencyController], clock: Clock, window_s: float = 0.25,
                 idle_poll_s: float = 0.02, max_groups: int | None = None, write_min_groups: int = 1,
                 write_max_wait_s: float = 1.0, batch_unused_groups: int = 0, move_on_switch: bool = True) -> None:
        if not controllers:
            raise ValueError("the feeder needs one concurrency controller per engine, got none")
        self.backend, self.state, self.gate, self.clock = backend, state, gate, clock
        self.controllers = list(controllers)  # engine i's in-flight target is controllers[i].target
        self.window_s, self.idle_poll_s, self.max_groups = window_s, idle_poll_s, max_groups
        # Fewer, larger appends: a Delta commit per window would leave thousands of small files.
        self.write_min_groups, self.write_max_wait_s = write_min_groups, write_max_wait_s
        self.batch_unused_groups = batch_unused_groups  # the selector's minimum of unused groups per batch
        self.move_on_switch = move_on_switch
        self._releasing: set[int] = set()  # flex engines asked to give back their requests (switching to train)
        self._last_write = clock.now()
        self._next_group = 0
        self._in_flight = 0  # requests
        self._in_flight_by_engine = [0] * len(self.controllers)
        # group in flight -> engine -> its requests running there (a group is dealt to one engine; requests a
        # flex worker gives back move to another)
        self._where: dict[int, Counter[int]] = {}
        self._partial: dict[int, list[Finished]] = {}
        self._oldest = GroupVersions()  # group with finished samples -> their oldest version (as _partial)
        self._complete: dict[int, list[Finished]] = {}
        self._abandoned: set[int] = set()  # groups given up while in flight (results still arriving are dropped)
        self._handle: Any = None
        self._chunk = 0
        self._written = 0  # groups written
        self._level_at: float | None = None  # when the level of unused groups was last integrated

    def resume_at(self, next_group: int, next_chunk: int) -> None:
        """Continue a resumed run's stream: groups from ``next_group``, writes as chunks from ``next_chunk``.

        Groups a killed attempt had in flight were never written; they are skipped, not re-generated.
        """
        self._next_group = self._written = next_group
        self._chunk = next_chunk

    @property
    def target(self) -> int:
        """The pool's in-flight target: the sum of the engines' targets."""
        return sum(c.target for c in self.controllers)

    def _admit(self) -> None:
        """Submit as many whole groups as the gate and the engines' concurrency targets allow.

        Each group goes to the engine with the most room below its own
        target (ties: the lower index), so every engine is filled to its
        target, whatever the others' targets.
        """
        with self.state.cond:
            ahead = self.in_flight_groups + self.state.admissible_unused(self.gate.max_staleness_versions)
            allowed = self.gate.allowed(ahead)
            training = {i for i, role in self.state.roles.items() if role == "train"}
        spg = self.backend.samples_per_group
        room = [0 if i in training else c.target - n
                for i, (c, n) in enumerate(zip(self.controllers, self._in_flight_by_engine))]
        n = min(allowed, sum(max(0, r) // spg for r in room))
        if self.max_groups is not None:
            n = min(n, self.max_groups - self._next_group)
        if n <= 0:
            return
        dealt: dict[int, list[int]] = {}  # (a flex worker set to train has no room: it gets nothing)
        for g in range(self._next_group, self._next_group + n):
            engine = max(range(len(room)), key=lambda i: (room[i], -i))
            dealt.setdefault(engine, []).append(g)
            room[engine] -= spg
            self._where[g] = Counter({engine: spg})
        for engine, groups in dealt.items():
            self.backend.submit(groups, engine)
            self._in_flight_by_engine[engine] += len(groups) * spg
        self._next_group += n
        self._in_flight += n * spg
        with self.state.cond:
            self.state.groups_submitted += n

    def _integrate_level(self) -> None:
        """Add the unused groups waiting since the last window, times its length, to ``unused_group_seconds``
        (the elastic pool's scheduler reads the window's mean level from it, not a sample right after a step
        consumed its batch)."""
        now = self.clock.now()
        with self.state.cond:
            if self._level_at is not None:
                self.state.unused_group_seconds += len(self.state.unused) * (now - self._level_at)
        self._level_at = now

    def _settle_switches(self, busy: dict[int, float]) -> None:
        """Finish the flex workers' switches the scheduler decided (``control.roles``), and time them.

        To train: done once the worker has nothing in flight (its requests
        finish where they run, each token keeping its version); it is then
        ``ready`` for the next step. To generate: done when its first window
        returns; the switch took the wait before that window (a share of a
        step it was still computing), not the window itself.
        """
        with self.state.cond:
            if not self.state.switching:
                return
            now = self.clock.now()
            for i, decided in list(self.state.switching.items()):
                if self.state.roles.get(i) == "train" and self._in_flight_by_engine[i] > 0:
                    if self.move_on_switch and i not in self._releasing:
                        self.backend.release(i)
                        self._releasing.add(i)
                    continue
                if self.state.roles.get(i) == "train":
                    self._releasing.discard(i)
                    self.state.ready.add(i)
                elif self.state.roles.get(i) == "generate" and i in busy:
                    self._releasing.discard(i)  # a later move to training asks it to give back again
                    now -= busy[i]
                else:
                    continue
                self.state.switch_seconds.append((i, self.state.roles[i], max(0.0, now - decided)))
                del self.state.switching[i]
                now = self.clock.now()

    def _redeal(self, released: Sequence[Released]) -> None:
        """Deal the requests flex engines gave back: each group's to the generating engine with the most room
        below its target (they were admitted already: a full engine takes them too)."""
        by_group: dict[int, list[Released]] = {}
        for item in released:
            if item.group in self._abandoned:  # aborted as it was given back
                continue
            by_group.setdefault(item.group, []).append(item)
        if not by_group:
            return
        with self.state.cond:
            training = {i for i, role in self.state.roles.items() if role == "train"}
        for g, items in by_group.items():
            engines = [i for i in range(len(self.controllers)) if i not in training] or [items[0].engine]
            to = max(engines, key=lambda i: (self.controllers[i].target - self._in_flight_by_engine[i], -i))
            self.backend.resubmit([item.request for item in items], to)
            for item in items:
                self._where[g][item.engine] -= 1
                self._in_flight_by_engine[item.engine] -= 1
            self._where[g][to] += len(items)
            self._in_flight_by_engine[to] += len(items)
        with self.state.cond:
            self.state.requests_moved += sum(map(len, by_group.values()))

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
        hopeless = self._oldest.expire(oldest_ok)
        if not hopeless:
            return
        self.backend.abandon(hopeless)
        self.backend.gave_up({g: self._partial[g] for g in hopeless})
        for g in hopeless:
            del self._partial[g]
            for engine, outstanding in self._where.pop(g).items():
                self._in_flight -= outstanding
                self._in_flight_by_engine[engine] -= outstanding
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
        started = self._last_write = self.clock.now()
        groups, self._complete = self._complete, {}
        self.backend.write(self._chunk, groups)
        self._chunk += 1
        self._written += len(groups)
        with self.state.cond:
            self.state.write_seconds += self.clock.now() - started
            self.state.writes += 1
            self.state.groups_written += len(groups)
            for g, items in groups.items():
                self.state.unused[g] = min(item.result.version for item in items)
            self.state.cond.notify_all()

    def run_once(self) -> bool:
        """One window: collect the last drain, admit groups, start the next drain, write finished groups.

        Returns False when there is nothing to do (nothing in flight and the
        gate closed); the caller then waits.
        """
        self._integrate_level()
        if self._handle is not None:
            drained = self.backend.wait_drain(self._handle)
            self._handle = None
            busy = drained.engine_busy()
            tokens = dict.fromkeys(busy, 0)
            finished = dict.fromkeys(busy, 0)
            late: dict[int, list[Finished]] = {}  # samples of groups given up already
            for item in drained.released:  # each engine is credited what it generated, where it finished or not
                tokens[item.engine] = tokens.get(item.engine, 0) + item.tokens
            for item in drained.finished:
                tokens[item.engine] = tokens.get(item.engine, 0) + item.tokens
                if item.group in self._abandoned:  # finished before its abort reached the engine
                    late.setdefault(item.group, []).append(item)
                    continue
                finished[item.engine] = finished.get(item.engine, 0) + 1
                self._where[item.group][item.engine] -= 1
                self._partial.setdefault(item.group, []).append(item)
                version = item.result.version
                self._oldest[item.group] = min(self._oldest.get(item.group, version), version)
                if len(self._partial[item.group]) == self.backend.samples_per_group:
                    self._complete[item.group] = self._partial.pop(item.group)
                    del self._oldest[item.group]
                    del self._where[item.group]
            # Admission is in whole groups, so a full engine sits up to one group below its target.
            saturated = {i: self._in_flight_by_engine[i] + self.backend.samples_per_group > self.controllers[i].target
                         for i in busy}
            for i, done in finished.items():
                self._in_flight_by_engine[i] -= done
            self._in_flight -= sum(finished.values())
            with self.state.cond:
                self.state.engine_busy_s += drained.busy_s
                self.state.generated_tokens += sum(tokens.values())
                for i, seconds in busy.items():
                    self.state.engine_seconds[i] = self.state.engine_seconds.get(i, 0.0) + seconds
                for i, count in tokens.items():
                    self.state.engine_tokens[i] = self.state.engine_tokens.get(i, 0) + count
            for i, seconds in busy.items():
                self.controllers[i].observe(tokens.get(i, 0), seconds, saturated[i])
            if late:
                self.backend.gave_up(late)
            self._redeal(drained.released)
            self._abandon_expired()
            self._settle_switches(busy)
        else:
            self._settle_switches({})
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
