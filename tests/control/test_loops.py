"""The streaming control plane against an in-process engine and trainer, over a real Delta buffer."""

from __future__ import annotations

import copy
import pickle
import random
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from reflow.control.clock import VirtualClock
from reflow.control.concurrency import ConcurrencyController
from reflow.control.feeder import Drained, FeederLoop, Finished, Released
from reflow.control.gate import StalenessGate
from reflow.control.roles import RolePool, RoleScheduler
from reflow.control.selector import SelectorLoop, StepOutcome
from reflow.control.state import LoopState
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.queries import recorded_batch
from reflow.storage.replay import ReplayPolicy, ReplaySelection, select_batch
from reflow.storage.schema import GenResult, Trajectory

RUN = "run"


def test_gate_caps_groups_ahead_of_the_trainer() -> None:
    gate = StalenessGate(max_staleness_versions=2, groups_per_step=4, batch_groups=4)
    assert gate.cap == 8  # AReaL's (S + 1) * groups per step, less one version of slack for the weight-push lag
    assert gate.allowed(ahead=0) == 8 and gate.allowed(ahead=6) == 2 and gate.allowed(ahead=20) == 0
    assert StalenessGate(max_staleness_versions=0, groups_per_step=4, batch_groups=4).cap == 4
    # reflow consumes 2 fresh groups per step of 8: the cap never drops below a full batch
    assert StalenessGate(max_staleness_versions=0, groups_per_step=2, batch_groups=8).cap == 8


def test_expired_groups_leave_the_gate() -> None:
    state = LoopState(trainer_version=5)
    state.unused.update({1: 2, 2: 3, 3: 5})
    assert state.admissible_unused(max_staleness_versions=2) == 2  # group 1 (version 2) aged out
    assert state.groups_expired == 1 and set(state.unused) == {2, 3}
    # the floor did not move: no scan, nothing expires; an older group written after the scan still does
    assert state.admissible_unused(max_staleness_versions=2) == 2 and state.unused.least == 3
    state.unused[4] = 1
    state.unused.setdefault(5, 2)
    state.unused |= {6: 7}
    assert state.unused.least == 1 and state.admissible_unused(max_staleness_versions=2) == 3
    assert state.groups_expired == 3 and set(state.unused) == {2, 3, 6}
    # a copy, deep or pickled, keeps the items and the bound
    copied = pickle.loads(pickle.dumps(state.unused))
    assert copied == state.unused and copied.least == state.unused.least == 3
    assert copy.deepcopy(state.unused).least == 3
    # a selection taking groups keeps the bound a bound; once the floor passes every group, none is left
    del state.unused[2]
    state.trainer_version = 10
    assert state.admissible_unused(max_staleness_versions=2) == 0 and state.groups_expired == 5
    # a state made from a plain dict (a resumed run's) knows its bound as well
    resumed = LoopState(trainer_version=5, unused={7: 1, 8: 4})
    assert resumed.admissible_unused(max_staleness_versions=2) == 1 and resumed.groups_expired == 1


class FakeEngine:
    """Finishes a random share of what is in flight each window; tokens carry the version that sampled them."""

    def __init__(self, rng: random.Random, samples: int) -> None:
        self.rng, self.samples_per_group = rng, samples
        self.version = 0
        self.in_flight: dict[str, list[int]] = {}  # request id -> token versions so far
        self.pending_weights: list[int] = []  # pushed but not loaded yet (loads between windows)
        self.written: list[Trajectory] = []
        self.abandoned: list[int] = []
        self.given_up: dict[int, list[int]] = {}  # group given up in flight -> lengths of its finished samples

    def submit(self, groups, engine: int = 0) -> None:
        for g in groups:
            for k in range(self.samples_per_group):
                self.in_flight[f"g{g}/p{g}/{k}"] = []

    def abandon(self, groups) -> None:
        self.abandoned += groups
        for rid in [r for r in self.in_flight if int(r.split("/")[0][1:]) in groups]:
            del self.in_flight[rid]

    def gave_up(self, finished) -> None:
        for g, items in finished.items():
            self.given_up.setdefault(g, []).extend(len(f.result.response_tokens) for f in items)

    def start_drain(self, window_s: float):
        if self.pending_weights:
            self.version = max(self.pending_weights)
            self.pending_weights.clear()
        return window_s

    def wait_drain(self, handle) -> Drained:
        finished = []
        for rid, versions in list(self.in_flight.items()):
            if versions and self.rng.random() < 0.05:  # re-issued (a restarted engine): starts over, newer
                versions.clear()
            versions.append(self.version)
            if self.rng.random() < 0.4:
                del self.in_flight[rid]
                result = GenResult(rid, [5] * len(versions), [-0.1] * len(versions), "stop", versions, versions[0])
                finished.append(Finished(int(rid.split("/")[0][1:]), result, len(versions)))
        return Drained(finished, busy_s=0.1, in_flight=len(self.in_flight))


class FakeFeeder(FakeEngine):
    def __init__(self, rng: random.Random, samples: int, store: DeltaTrajectoryStore) -> None:
        super().__init__(rng, samples)
        self.store = store

    def write(self, chunk: int, groups) -> None:
        records = []
        for g, items in groups.items():
            for item in items:
                r = item.result
                k = int(r.request_id.rsplit("/", 1)[1])
                records.append(Trajectory(
                    trajectory_id=f"{RUN}/{r.request_id}", run_id=RUN, prompt_id=f"p{g}", group_id=f"{RUN}/g{g}",
                    sample_index=k, env="arith", rollout_step=chunk, policy_version=r.version, prompt_tokens=[1],
                    response_tokens=r.response_tokens, behaviour_logprobs=r.logprobs, token_versions=r.token_versions,
                    loss_mask=[1] * len(r.response_tokens), reward=float(self.rng.random() < 0.5), correct=False,
                    finish_reason="stop", response_length=len(r.response_tokens)))
        self.store.append_trajectories(records, app_id=f"{RUN}:trajectories", txn_version=chunk)
        self.written += records


class FakeSelector:
    def __init__(self, store: DeltaTrajectoryStore, engine: FakeEngine, policy: ReplayPolicy, groups: int,
                 samples: int) -> None:
        self.store, self.engine, self.policy, self.groups, self.samples = store, engine, policy, groups, samples
        # the writer's store, as in a run (one store per root and process, tasks.context): its selection window is
        # fed by the writer's commits (storage.window)
        self.tables = store
        self.version = 0
        self.batches: dict[int, ReplaySelection] = {}
        self.recorded: list[tuple[int, int]] = []  # (step, newest weights pushed when it was recorded)
        self.computing: tuple[int, ReplaySelection] | None = None
        self.rng: random.Random | None = None  # set: a step takes 0 to 3 polls to finish
        self.polls_left = 0
        self.early = 0  # steps started before the one before was recorded
        self.prefetched: list[ReplaySelection] = []  # batches handed to the trainer while it computed
        self.handed: ReplaySelection | None = None  # the one handed over and not started yet

    def select(self, step: int, trainer_version: int) -> ReplaySelection:
        return select_batch(self.tables, RUN, trainer_version, self.groups, self.policy,
                            lambda reuse, age: 0.5**reuse * 0.9**age, samples_per_prompt=self.samples)

    def consumed(self, selection: ReplaySelection) -> tuple[int, ...]:
        return tuple(sorted({int(g.rsplit("/g", 1)[1]) for g, k in zip(selection.group_ids, selection.kinds)
                             if k != "replay"}))

    def uses_trainer(self, step: int) -> bool:
        return step % 3 == 2  # "checkpoint" steps

    def prefetch(self, selection: ReplaySelection) -> None:
        assert self.computing is not None, "a batch is handed over early only while the step before computes"
        assert self.handed is None, "a second batch handed over before the first was trained"
        self.prefetched.append(selection)
        self.handed = selection

    def start_train(self, step: int, selection: ReplaySelection) -> tuple[int, ReplaySelection]:
        assert self.computing is None, "the trainer runs one step at a time"
        assert self.handed in (None, selection), "a step started on another batch than the one handed over"
        self.handed = None
        if step > 0 and self.uses_trainer(step - 1):
            assert self.recorded[-1][0] == step - 1, "a step started before the checkpoint of the one before"
        self.early += step > 0 and self.recorded[-1:] != [(step - 1, self.version)]  # started before recording
        assert selection.trainer_version == self.version, "a batch chosen for another version"
        self.store.append_usage(selection.usage_rows(RUN, step, selection.trainer_version), app_id=f"{RUN}:usage",
                                txn_version=step)
        self.batches[step] = selection
        self.computing = (step, selection)
        self.polls_left = self.rng.randrange(4) if self.rng is not None else 0
        return self.computing

    def finish_train(self, handle: tuple[int, ReplaySelection], timeout: float | None) -> StepOutcome | None:
        assert handle is self.computing
        if timeout is not None and self.polls_left > 0:
            self.polls_left -= 1
            return None
        self.computing = None
        self.version += 1
        selection = handle[1]
        return StepOutcome(version=self.version, groups=len(set(selection.group_ids)),
                           consumed=self.consumed(selection))

    def push_weights(self, version: int) -> None:
        self.engine.pending_weights.append(version)

    def record(self, step: int) -> None:
        self.recorded.append((step, self.engine.pending_weights[-1]))  # the weights were pushed first


@pytest.mark.parametrize("seed,replay,stale,ahead,reuse", [
    (0, False, 1, False, 1), (1, True, 1, False, 2), (2, True, 1, False, 2), (3, True, 0, False, 2),
    (4, False, 0, False, 1), (5, True, 1, True, 2), (6, True, 2, True, 2), (7, True, 3, True, 2),
    # windows of 4 and 5 versions: a group stays admissible for more steps than it may be used, so the reuse
    # cap binds, and groups whose samples span versions sit half inside the window
    (8, True, 3, False, 2), (9, True, 4, True, 2), (10, True, 4, False, 2)])
def test_random_schedules_keep_staleness_replay_and_groups(tmp_path: Path, seed: int, replay: bool,
                                                           stale: int, ahead: bool, reuse: int) -> None:
    """Feeder windows and selector attempts in random order: every batch obeys every bound, and nothing stalls.

    ``ahead``: the selector chooses each batch while the step before computes
    (which takes a random number of polls), for the version after it.
    """
    rng = random.Random(seed)
    groups, samples = 3, 4
    # wide windows: replay most of a batch, by advantage (the same high-spread groups again and again), so the
    # reuse cap binds; newest-first would replay each group once before any twice
    wide = stale >= 3
    policy = ReplayPolicy(max_staleness_versions=stale, replay_ratio=(0.75 if wide else 0.5) if replay else 0.0,
                          max_reuse=reuse, replay_order="advantage" if wide else "newest")
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    state = LoopState()
    fresh_per_step = 2 if replay else groups
    engine = FakeFeeder(rng, samples, store)
    controller = ConcurrencyController(initial=16, minimum=4, maximum=32, increase=4, window_s=0.3)
    gate = StalenessGate(stale, fresh_per_step, groups)
    feeder = FeederLoop(engine, state, gate, [controller], VirtualClock())
    trainer = FakeSelector(store, engine, policy, groups, samples)
    selector = SelectorLoop(trainer, state, groups, VirtualClock(), min_unused_groups=fresh_per_step,
                            select_ahead=ahead)
    if ahead:
        trainer.rng = rng
    step = 0
    for _ in range(120):
        if rng.random() < 0.6:
            feeder.run_once()
        elif selector.try_start(step) if ahead else selector.try_step(step) is not None:
            step += 1
        # the gate's bound on groups ahead of the trainer (in flight + admissible unused)
        assert feeder.in_flight_groups + state.admissible_unused(stale) <= gate.cap
        if not replay and state.groups_expired == 0:  # AReaL's form of the same bound
            assert state.groups_submitted <= (trainer.version + stale + 1) * fresh_per_step
    selector.finish()  # the step under way
    assert step >= 6, "the schedule should keep training (no deadlock between the loops)"
    if ahead:  # some batches were chosen while the step before was computing, and trained one version later
        assert selector.selected_ahead > 0 and len(trainer.prefetched) == selector.selected_ahead
        assert trainer.early > 0, "no step started before the push and record of the one before"
    else:
        assert trainer.early == 0
    assert trainer.recorded == [(s, s + 1) for s in range(step)], "each step is recorded once, after its push"

    written = {r.trajectory_id: r for r in engine.written}
    uses: Counter[str] = Counter()
    for s in range(step):
        sel = trainer.batches[s]
        tv = sel.trainer_version
        members = defaultdict(list)
        for tid, gid, kind, w in zip(sel.trajectory_ids, sel.group_ids, sel.kinds, sel.loss_weights):
            row = written[tid]
            assert 0 <= tv - min(row.token_versions) <= stale, "staleness bound violated"
            assert row.policy_version == min(row.token_versions)
            assert uses[tid] < policy.max_reuse, "reuse cap violated"
            assert (kind == "replay") == (uses[tid] > 0)
            members[gid].append(tid)
        assert all(len(m) == samples for m in members.values()), "a GRPO group was split"
        if s == 0:  # the first batch: nothing to replay yet, so the minimum of unused groups is enough
            assert fresh_per_step <= len(members) <= groups and sel.replay_share == 0
        else:
            assert len(members) == groups
        assert sel.replay_share <= policy.replay_ratio + 1e-9
        assert recorded_batch(store, RUN, s) == dict(zip(sel.trajectory_ids, sel.loss_weights))
        uses.update(sel.trajectory_ids)
    if replay and stale > 0:  # at S = 0 nothing already trained on is still admissible
        assert any(trainer.batches[s].replay_share > 0 for s in range(step)), "replay never filled a batch"
    if reuse < stale + 1 and replay:  # the cap can bind: some trajectory was trained on exactly max_reuse times
        assert max(uses.values()) == reuse, "the reuse cap was never reached: this schedule cannot test it"
    if stale >= 2:  # wide windows: some group's samples start at different versions (a re-issued request)
        spans = {gid for gid in {r.group_id for r in engine.written}
                 if len({r.policy_version for r in engine.written if r.group_id == gid}) > 1}
        assert spans, "no group's samples span versions: the whole-group rule was not exercised"
    assert not {f"{RUN}/g{g}" for g in engine.abandoned} & {r.group_id for r in engine.written}
    assert state.groups_abandoned == len(engine.abandoned)


def test_first_batch_starts_with_the_minimum_of_unused_groups_and_later_ones_wait_for_a_full_batch(
        tmp_path: Path) -> None:
    """Step 0 has nothing to replay: it trains on ``min_unused_groups``; step 1 needs a full batch."""
    samples, groups = 2, 4
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    engine = FakeFeeder(random.Random(0), samples, store)
    trainer = FakeSelector(store, engine, ReplayPolicy(max_staleness_versions=2, replay_ratio=0.5, max_reuse=2),
                           groups, samples)
    state = LoopState()
    selector = SelectorLoop(trainer, state, groups, VirtualClock(), min_unused_groups=2)

    def write(first: int, count: int, version: int) -> None:
        engine.version = version
        items = {g: [Finished(g, GenResult(f"g{g}/{k}", [5], [-0.1], "stop", [version], version), 1)
                     for k in range(samples)] for g in range(first, first + count)}
        engine.write(first, items)
        with state.cond:
            state.groups_written += count
            state.unused.update({g: version for g in items})

    write(0, 1, 0)
    assert selector.try_step(0) is None, "one unused group is below the minimum"
    write(1, 1, 0)
    first = selector.try_step(0)
    assert first is not None and first.groups == 2 and trainer.batches[0].replay_share == 0
    write(2, 1, 1)
    assert selector.try_step(1) is None, "one unused group: below the minimum at every step"
    write(3, 1, 1)
    second = trainer.batches[1] if selector.try_step(1) is not None else None
    assert second is not None and len(set(second.group_ids)) == groups
    assert second.kinds.count("replay") == 2 * samples


@pytest.mark.parametrize("ahead", [False, True])
def test_run_ends_at_the_step_that_spends_the_new_groups_budget(tmp_path: Path, ahead: bool) -> None:
    """``max_new_groups``: with two new groups written per step, a batch of 4 holds 2 new and 2 replayed
    groups, so a budget of 6 new groups takes 3 steps (a full batch of new groups each would take 2)."""
    samples, groups = 2, 4
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    engine = FakeFeeder(random.Random(0), samples, store)
    state = LoopState()
    written = [0]

    def write(count: int) -> None:
        first, version = written[0], engine.version
        items = {g: [Finished(g, GenResult(f"g{g}/{k}", [5], [-0.1], "stop", [version], version), 1)
                     for k in range(samples)] for g in range(first, first + count)}
        engine.write(first, items)
        written[0] += count
        with state.cond:
            state.groups_written += count
            state.unused.update({g: version for g in items})

    class Feeding(FakeSelector):  # the feeder writes two groups while each step computes
        def start_train(self, step, selection):
            handle = super().start_train(step, selection)
            write(2)
            return handle

        def uses_trainer(self, step: int) -> bool:
            return False

    trainer = Feeding(store, engine, ReplayPolicy(max_staleness_versions=8, replay_ratio=0.5, max_reuse=2),
                      groups, samples)
    selector = SelectorLoop(trainer, state, groups, VirtualClock(), min_unused_groups=2, select_ahead=ahead,
                            max_new_groups=6)
    write(2)
    selector.run(range(100))
    assert sorted(trainer.batches) == [0, 1, 2] and selector.final_step == 2
    assert [trainer.batches[s].kinds.count("replay") // samples for s in range(3)] == [0, 2, 2]
    assert selector.new_groups == 6 and trainer.recorded[-1][0] == 2, "the last step is collected and recorded"
    resumed = SelectorLoop(trainer, state, groups, VirtualClock(), min_unused_groups=2, select_ahead=ahead,
                           max_new_groups=6, new_groups=6)
    resumed.run(range(3, 100))  # a resumed run whose budget was spent before the kill trains nothing more
    assert sorted(trainer.batches) == [0, 1, 2] and resumed.final_step is None


def test_feeder_abandons_groups_that_aged_out_in_flight() -> None:
    """A group with a finished sample older than the window is aborted; its late results are dropped, and the
    lengths of its samples that finished are recorded, the late ones too."""
    class Scripted(FakeEngine):
        def __init__(self) -> None:
            super().__init__(random.Random(0), 2)
            self.finish: list[str] = []  # request ids the next window finishes

        def wait_drain(self, handle) -> Drained:
            finished = []
            for rid in self.finish:
                self.in_flight.pop(rid, None)
                n = 3 + int(rid.rsplit("/", 1)[1])  # sample k has 3 + k tokens
                result = GenResult(rid, [5] * n, [-0.1] * n, "stop", [self.version] * n, self.version)
                finished.append(Finished(int(rid.split("/")[0][1:]), result, 1))
            self.finish = []
            return Drained(finished, busy_s=0.1, in_flight=len(self.in_flight))

        def write(self, chunk, groups) -> None:
            self.written_groups = [*getattr(self, "written_groups", []), *groups]

    state = LoopState()
    engine = Scripted()
    feeder = FeederLoop(engine, state, StalenessGate(1, 2, 2), [ConcurrencyController(4, 2, 4, 1)], VirtualClock(),
                        write_min_groups=1)
    feeder.run_once()  # admits groups 0 and 1 (the gate's cap: 2 groups ahead)
    assert feeder.in_flight_groups == 2 and len(engine.in_flight) == 4
    engine.finish = ["g0/p0/0"]  # sampled at version 0
    feeder.run_once()
    state.set_version(2)  # the window is now versions 1..2: group 0 can never be trained on
    engine.version = 2  # the engine has the new weights
    engine.finish = ["g1/p1/0"]
    feeder.run_once()
    assert engine.abandoned == [0] and state.groups_abandoned == 1
    assert "g0/p0/1" not in engine.in_flight, "the rest of the group was not aborted"
    assert engine.given_up == {0: [3]}  # its sample 0, finished at version 0
    assert feeder.in_flight_groups == 2  # group 1 and a new group in group 0's place
    engine.finish = ["g0/p0/1", "g1/p1/1"]  # group 0's last sample finished before its abort arrived
    feeder.run_once()
    feeder._flush(force=True)
    assert engine.written_groups == [1]
    assert feeder._in_flight == len(engine.in_flight)  # late results were not counted twice
    assert engine.given_up == {0: [3, 4]}  # and its sample 1, which finished after


def test_feeder_failure_stops_the_selector(tmp_path: Path) -> None:
    class Broken(FakeEngine):
        def write(self, chunk, groups):
            raise OSError("disk full")

    state = LoopState()
    engine = Broken(random.Random(0), 2)
    feeder = FeederLoop(engine, state, StalenessGate(1, 1, 1), [ConcurrencyController(4, 2, 4, 1)], VirtualClock())
    feeder.run()  # returns once the error stopped the loops
    assert state.stop and isinstance(state.error, OSError)
    selector = SelectorLoop(FakeSelector(DeltaTrajectoryStore(str(tmp_path)), engine,
                                         ReplayPolicy(1, 0.0, 1), 1, 2), state, 1, VirtualClock(), 1)
    done = threading.Thread(target=selector.run, args=(range(3),), daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive(), "the selector kept waiting for groups after the feeder failed"
    assert selector.backend.batches == {} and selector.training is None  # no step trained or started


def test_feeder_batches_appends_by_groups_or_time(tmp_path: Path) -> None:
    class Recorder(FakeEngine):
        def __init__(self) -> None:
            super().__init__(random.Random(5), 2)
            self.chunks: list[int] = []

        def write(self, chunk, groups) -> None:
            self.chunks.append(len(groups))
            self.times.append(clock.now())

    clock = VirtualClock()
    engine = Recorder()
    engine.times = []
    state = LoopState()
    feeder = FeederLoop(engine, state, StalenessGate(4, 4, 4), [ConcurrencyController(8, 2, 8, 1)], clock,
                        write_min_groups=3, write_max_wait_s=1.0)
    for _ in range(40):
        feeder.run_once()
        clock.advance(0.05)  # 40 windows: 2 s, so the time rule fires at most twice
    assert len(engine.chunks) >= 2
    previous = 0.0
    for n, t in zip(engine.chunks, engine.times):  # each append: enough groups, or a second since the last
        assert n >= 3 or t - previous >= 1.0 - 1e-9, (n, t, previous)
        previous = t
    before = sum(engine.chunks)
    state.request_stop()
    feeder.run()  # the final flush writes whatever is complete
    assert sum(engine.chunks) == state.groups_written >= before


def test_feeder_writes_at_once_the_groups_that_complete_a_batch() -> None:
    """Below the write batching: groups that bring the unused ones up to a batch's minimum are written at once."""
    class Recorder(FakeEngine):
        def __init__(self) -> None:
            super().__init__(random.Random(0), 2)
            self.chunks: list[int] = []

        def wait_drain(self, handle) -> Drained:  # one whole group finishes per window
            rids = sorted(self.in_flight, key=lambda r: int(r.split("/")[0][1:]))[:2]
            finished = []
            for rid in rids:
                del self.in_flight[rid]
                finished.append(Finished(int(rid.split("/")[0][1:]), GenResult(rid, [5], [-0.1], "stop", [0], 0), 1))
            return Drained(finished, busy_s=0.1, in_flight=len(self.in_flight))

        def write(self, chunk, groups) -> None:
            self.chunks.append(len(groups))

    clock = VirtualClock()
    engine, state = Recorder(), LoopState()
    state.unused.update({100: 0, 101: 0})  # two unused groups written before; a batch needs three
    feeder = FeederLoop(engine, state, StalenessGate(4, 4, 4), [ConcurrencyController(8, 2, 8, 1)], clock,
                        write_min_groups=3, write_max_wait_s=10.0, batch_unused_groups=3)
    feeder.run_once()  # submits
    feeder.run_once()  # one group complete: with the two unused it makes a batch, so it is written alone
    assert engine.chunks == [1] and len(state.unused) == 3
    for _ in range(3):
        feeder.run_once()  # enough unused now: back to batches of three
    assert engine.chunks == [1, 3]
    state.unused.clear()  # a step consumed them: the next groups wait for three again (none is enough alone)
    feeder.run_once()
    feeder.run_once()
    assert engine.chunks == [1, 3]


def test_controller_sees_an_engine_kept_full_in_whole_groups(tmp_path: Path) -> None:
    """Samples finish one by one but groups are admitted whole: a full engine is up to a group below target."""
    class Steady(FakeEngine):
        def wait_drain(self, handle) -> Drained:
            finished = []
            for rid in list(self.in_flight)[:3]:  # 3 samples per window: rarely a whole group of room
                del self.in_flight[rid]
                result = GenResult(rid, [5] * 4, [-0.1] * 4, "stop", [0] * 4, 0)
                finished.append(Finished(int(rid.split("/")[0][1:]), result, 4))
            return Drained(finished, busy_s=0.5, in_flight=len(self.in_flight))

        def write(self, chunk, groups) -> None:
            pass

    state = LoopState()
    controller = ConcurrencyController(initial=64, minimum=16, maximum=256, increase=16, window_s=1.0)
    feeder = FeederLoop(Steady(random.Random(0), 8), state, StalenessGate(1000, 1000, 1000), [controller],
                        VirtualClock())
    for _ in range(12):
        feeder.run_once()
    assert controller.decisions, "windows of a full engine must count"
    assert controller.target > 64


class TwoEngines:
    """Two engines: engine 0 finishes half of what it holds per window (more in flight, more tokens per second);
    engine 1 finishes two requests per window, and one once it holds more than 12 (memory pressure: preemption)."""

    samples_per_group = 4

    def __init__(self) -> None:
        self.held: dict[int, list[str]] = {0: [], 1: []}
        self.dealt: dict[int, list[int]] = {0: [], 1: []}
        self.abandoned: list[int] = []

    def submit(self, groups, engine: int = 0) -> None:
        self.dealt[engine] += groups
        self.held[engine] += [f"g{g}/p{g}/{k}" for g in groups for k in range(self.samples_per_group)]

    def start_drain(self, window_s: float):
        return window_s

    def wait_drain(self, handle) -> Drained:
        finished = []
        for engine, count in ((0, len(self.held[0]) // 2), (1, 2 if len(self.held[1]) <= 12 else 1)):
            done, self.held[engine] = self.held[engine][:count], self.held[engine][count:]
            finished += [Finished(int(rid.split("/")[0][1:]),
                                  GenResult(rid, [5] * 10, [-0.1] * 10, "stop", [0] * 10, 0),
                                  10, engine) for rid in done]
        return Drained(finished, busy_s=1.0, in_flight=len(self.held[0]) + len(self.held[1]),
                       busy_by_engine={0: 1.0, 1: 1.0})

    def write(self, chunk, groups) -> None:
        pass

    def gave_up(self, finished) -> None:
        pass

    def abandon(self, groups) -> None:
        self.abandoned += groups
        for engine in self.held:
            self.held[engine] = [r for r in self.held[engine] if int(r.split("/")[0][1:]) not in groups]


def test_each_engine_has_its_own_target_and_is_filled_to_it() -> None:
    engines, state = TwoEngines(), LoopState()
    controllers = [ConcurrencyController(initial=8, minimum=4, maximum=64, increase=4, window_s=1.0) for _ in range(2)]
    feeder = FeederLoop(engines, state, StalenessGate(1000, 1000, 1000), controllers, VirtualClock())
    for _ in range(30):
        dealt = {engine: len(groups) for engine, groups in engines.dealt.items()}
        feeder.run_once()
        for engine in (0, 1):  # the feeder's count is the engine's; new groups never take it past its own target
            assert feeder._in_flight_by_engine[engine] == len(engines.held[engine])
            if len(engines.dealt[engine]) > dealt[engine]:
                assert len(engines.held[engine]) <= controllers[engine].target
    # engine 0's tokens per second grew with its target up to the maximum; engine 1's fell and it backed off
    assert controllers[0].target == 64 and controllers[1].target < 64, (controllers[0].target, controllers[1].target)
    assert feeder.target == controllers[0].target + controllers[1].target
    assert "increase" in {d[2] for d in controllers[0].decisions}
    assert "decrease" in {d[2] for d in controllers[1].decisions}
    # every group went to one engine, whole; each engine's tokens and stepping seconds are counted apart
    assert not set(engines.dealt[0]) & set(engines.dealt[1])
    assert state.engine_seconds == {0: 29.0, 1: 29.0}  # the first call only submits and starts a window
    assert state.engine_tokens[0] > 2 * state.engine_tokens[1]
    assert state.generated_tokens == state.engine_tokens[0] + state.engine_tokens[1]


def test_abandoned_groups_free_their_own_engine() -> None:
    class OneEach(TwoEngines):  # each window, one sample of every group in flight finishes
        def wait_drain(self, handle) -> Drained:
            finished = []
            for engine, held in self.held.items():
                firsts = {}
                for rid in held:
                    firsts.setdefault(rid.split("/")[0], rid)
                for rid in firsts.values():
                    held.remove(rid)
                    finished.append(Finished(int(rid.split("/")[0][1:]),
                                             GenResult(rid, [5], [-0.1], "stop", [0], 0), 1, engine))
            return Drained(finished, busy_s=1.0, in_flight=sum(map(len, self.held.values())),
                           busy_by_engine={0: 1.0, 1: 1.0})

    engines, state = OneEach(), LoopState()
    controllers = [ConcurrencyController(12, 4, 12, 4), ConcurrencyController(8, 4, 8, 4)]
    feeder = FeederLoop(engines, state, StalenessGate(1, 1000, 1000), controllers, VirtualClock())
    feeder.run_once()  # each group to the most room (12 against 8, then 8 against 8: the lower index...)
    assert engines.dealt == {0: [0, 1, 3], 1: [2, 4]}
    feeder.run_once()  # one sample of each group finishes at version 0; nothing new fits
    assert engines.dealt == {0: [0, 1, 3], 1: [2, 4]} and feeder._in_flight_by_engine == [9, 6]
    state.set_version(2)  # version 0 is out of the window: every group with a finished sample is hopeless
    feeder.run_once()
    assert sorted(engines.abandoned) == [0, 1, 2, 3, 4]
    # the aborted requests left their own engine's count, and new groups refilled each to its own target
    assert engines.dealt == {0: [0, 1, 3, 5, 6, 8], 1: [2, 4, 7, 9]}
    assert feeder._in_flight_by_engine == [len(engines.held[0]), len(engines.held[1])] == [12, 8]


def test_a_flex_worker_moved_to_training_finishes_its_requests_then_is_ready_and_comes_back() -> None:
    """Engine 1 is a flex worker: the scheduler moves it to training when the buffer runs over its band; it gets
    no new group, its requests finish where they run (``pool.in_flight = "finish"``), then it is ready (the
    switch timed); moved back to generation it is dealt groups again, and no group is lost or dealt twice."""
    engines, state, clock = TwoEngines(), LoopState(), VirtualClock()
    controllers = [ConcurrencyController(8, 8, 8, 4), ConcurrencyController(8, 8, 8, 4)]
    feeder = FeederLoop(engines, state, StalenessGate(1000, 1000, 1000), controllers, clock, move_on_switch=False)
    scheduler = RoleScheduler(["generate"], clock, low=0.5, high=1.5, dwell_s=5.0)
    pool = RolePool(scheduler, state, flex=[1], batch_groups=2, window_s=1.0, switch_estimate_s=0.0)
    for _ in range(3):
        feeder.run_once()
        clock.advance(1.0)
    assert engines.dealt[1] and state.roles == {1: "generate"} and pool.ready() == []
    pool.tick()  # starts the first window
    with state.cond:
        state.groups_written += 8  # four batches waiting and rising: training is the slow stage
        state.unused.update({100 + g: 0 for g in range(8)})
    for _ in range(5):  # past the first dwell (a worker keeps its first role that long too); the feeder samples
        clock.advance(1.0)  # the level each window
        feeder.run_once()
    decision = pool.tick()
    assert decision is not None and decision.role == "train" and state.roles == {1: "train"}
    dealt = len(engines.dealt[1])
    assert decision.rates.buffer_groups >= 8  # the window's mean level: the 8 put there, and what was written
    while engines.held[1]:
        assert pool.ready() == []  # not before its last request finished
        feeder.run_once()
        clock.advance(1.0)
    feeder.run_once()
    assert pool.ready() == [1] and len(engines.dealt[1]) == dealt  # nothing new was dealt to it
    assert len(state.switch_seconds) == 1 and state.switch_seconds[0][:2] == (1, "train")
    assert state.switch_seconds[0][2] > 0
    # the buffer runs dry while the trainer consumes fast: back to generation after the dwell
    assert pool.tick().workers == ()  # (a new window starts; nothing can move within the dwell)
    for _ in range(5):
        with state.cond:  # the trainer takes every group as it is written, and more
            state.groups_consumed += len(state.unused) + 8
            state.unused.clear()
        clock.advance(1.0)
        feeder.run_once()
    decision = pool.tick()
    assert decision is not None and decision.role == "generate" and pool.ready() == []
    for _ in range(3):
        feeder.run_once()
        clock.advance(1.0)
    assert len(engines.dealt[1]) > dealt and len(state.switch_seconds) == 2
    assert state.switch_seconds[1][:2] == (1, "generate")
    figures = pool.figures(pool.finished_switches())
    assert (figures.generators, figures.trainers, figures.switches) == (1, 0, 2)
    assert figures.switch_seconds == (state.switch_seconds[0][2] + state.switch_seconds[1][2]) / 2
    every = engines.dealt[0] + engines.dealt[1]
    assert len(every) == len(set(every))  # no group dealt twice


class GivingBack(TwoEngines):
    """TwoEngines whose engines give back what they hold when asked (``release``): each request with the tokens it
    generated so far, one per window it ran, stamped with the engine's version."""

    def __init__(self) -> None:
        super().__init__()
        self.releasing: set[int] = set()
        self.tokens: dict[str, list[int]] = {}  # request id -> versions of its tokens so far
        self.came_with: Counter[str] = Counter()  # request id -> tokens it had when it reached its engine
        self.stepped: Counter[int] = Counter()  # engine -> tokens it generated
        self.finished_ids: Counter[str] = Counter()
        self.version = 0

    def release(self, engine: int) -> None:
        self.releasing.add(engine)

    def resubmit(self, requests, engine: int) -> None:
        self.held[engine] += [rid for rid, _ in requests]
        for rid, versions in requests:
            assert self.tokens[rid] == versions, "a moved request lost or changed its tokens"
            self.came_with[rid] = len(versions)

    def here(self, rid: str) -> int:
        """Tokens of ``rid`` its present engine generated."""
        return len(self.tokens.get(rid, [])) - self.came_with[rid]

    def wait_drain(self, handle) -> Drained:
        released = []
        for engine in sorted(self.releasing):
            released += [Released(int(rid.split("/")[0][1:]), (rid, list(self.tokens.get(rid, []))), engine,
                                  self.here(rid)) for rid in self.held[engine]]
            self.held[engine] = []
        self.releasing.clear()
        finished = []
        for engine, held in self.held.items():
            for rid in held:
                self.tokens.setdefault(rid, []).append(self.version)
            self.stepped[engine] += len(held)
            count = (len(held) + 1) // 2  # half of what it holds finishes (at least one)
            done, self.held[engine] = held[:count], held[count:]
            self.finished_ids.update(done)
            finished += [Finished(int(rid.split("/")[0][1:]), GenResult(rid, [5] * len(self.tokens[rid]),
                                  [-0.1] * len(self.tokens[rid]), "stop", self.tokens[rid], 0),
                                  self.here(rid), engine) for rid in done]
        return Drained(finished, busy_s=1.0, in_flight=len(self.held[0]) + len(self.held[1]),
                       busy_by_engine={0: 1.0, 1: 1.0}, released=released)


def test_a_flex_worker_moved_to_training_gives_back_its_requests_and_is_ready_a_window_later() -> None:
    """``pool.in_flight = "move"``: the worker's requests go, with their tokens, to the generating engine, and it
    is ready once they are off it (not after its longest one); every request finishes exactly once."""
    engines, state, clock = GivingBack(), LoopState(), VirtualClock()
    controllers = [ConcurrencyController(8, 8, 8, 4), ConcurrencyController(12, 12, 12, 4)]
    feeder = FeederLoop(engines, state, StalenessGate(1000, 1000, 1000), controllers, clock, max_groups=12)
    complete: list[int] = []
    engines.write = lambda chunk, groups: complete.extend(groups)  # type: ignore[method-assign]
    state.roles[1] = "generate"
    feeder.run_once()
    assert len(engines.held[1]) == 12, "the flex engine got its share"
    with state.cond:  # the scheduler's decision (control.roles.RolePool.tick)
        state.roles[1] = "train"
        state.switching[1] = clock.now()
    clock.advance(1.0)
    feeder.run_once()  # its window ends: the feeder asks it to give back what still runs
    assert engines.releasing == {1} and pool_ready(state) == set()
    moving = list(engines.held[1])
    clock.advance(1.0)
    feeder.run_once()  # given back and re-dealt to engine 0, even above its target; the worker is ready
    assert engines.held[1] == [] and set(moving) <= set(engines.held[0])
    assert pool_ready(state) == {1} and state.requests_moved == len(moving) > 0
    assert state.switch_seconds == [(1, "train", 2.0)]
    assert feeder._in_flight_by_engine == [len(engines.held[0]), 0]
    while feeder._in_flight:
        clock.advance(1.0)
        feeder.run_once()
        assert not engines.held[1], "nothing dealt to a worker set to train"
    feeder._flush(force=True)
    assert sorted(complete) == sorted(set(engines.dealt[0] + engines.dealt[1])), "a group lost or written twice"
    assert feeder._where == {} and feeder._in_flight_by_engine == [0, 0]
    assert set(engines.finished_ids.values()) == {1} and len(engines.finished_ids) == 12 * 4
    # each engine is credited the tokens it generated: the moved requests' first tokens are the flex worker's
    assert state.engine_tokens == dict(engines.stepped) and engines.stepped[1] > 0
    assert state.generated_tokens == sum(len(versions) for versions in engines.tokens.values())


def pool_ready(state: LoopState) -> set[int]:
    with state.cond:
        return set(state.ready)


def test_a_worker_sent_back_to_generation_before_it_gave_back_is_asked_again_on_its_next_move() -> None:
    engines, state, clock = GivingBack(), LoopState(), VirtualClock()
    controllers = [ConcurrencyController(8, 8, 8, 4), ConcurrencyController(12, 12, 12, 4)]
    feeder = FeederLoop(engines, state, StalenessGate(1000, 1000, 1000), controllers, clock, max_groups=40)
    state.roles[1] = "generate"
    feeder.run_once()

    def move(role: str) -> None:
        with state.cond:
            state.roles[1] = role
            state.switching[1] = clock.now()
        clock.advance(1.0)

    move("train")
    feeder.run_once()  # asked to give back
    assert engines.releasing == {1}
    engines.releasing.clear()  # the release never reached the engine
    move("generate")
    feeder.run_once()  # back to generation: settled, dealt new groups
    assert 1 not in state.switching and engines.held[1]
    move("train")
    feeder.run_once()
    assert engines.releasing == {1}, "the second move to training did not ask the worker to give back"
