"""SortedRL scheduling against an in-process engine: loading, early termination, cache, sorting, restarts."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from reflow.control.clock import VirtualClock
from reflow.control.sorted_rounds import SortedScheduler
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.schema import GenRequest, GenResult, RoundRun


class FakeEngine:
    """Each request decodes ``per_window`` tokens per window (slots permitting) up to its target length."""

    def __init__(self, clock: VirtualClock, target: dict[int, int], max_sequences: int = 64,
                 per_window: int = 4) -> None:
        self.clock, self.target, self.max_sequences, self.per_window = clock, target, max_sequences, per_window
        self.window_s = 0.05
        self.version = 0
        self.running: dict[str, tuple[GenRequest, list[int], list[int]]] = {}  # id -> (request, tokens, versions)
        self.submitted: list[GenRequest] = []

    def submit(self, requests) -> None:
        for r in requests:
            assert r.request_id not in self.running, "a request was submitted twice"
            self.running[r.request_id] = (r, list(r.resume_tokens), list(r.resume_versions))
            self.submitted.append(r)

    def drain(self, window_s: float):
        self.clock.advance(window_s)
        done, busy = [], 0.0
        for rid in list(self.running)[: self.max_sequences]:
            req, tokens, versions = self.running[rid]
            busy += window_s
            g = int(rid.split("/")[0][1:])
            for _ in range(self.per_window):
                tokens.append(7)
                versions.append(self.version)
                if len(tokens) >= min(self.target[g], req.max_tokens):
                    del self.running[rid]
                    done.append(self._result(req, tokens, versions, "stop"))
                    break
        return done, busy

    def run_round(self, queue, goal) -> RoundRun:
        """Windows of ``window_s``, topped up from ``queue`` to ``max_sequences``, until the goal is met."""
        start, finished, busy, windows, started = self.clock.now(), [], 0.0, 0, 0
        while not goal.met():
            free = self.max_sequences - len(self.running)
            self.submit(queue[started:started + max(free, 0)])
            started = min(len(queue), started + max(free, 0))
            if not self.running:
                break
            done, slot_s = self.drain(self.window_s)
            busy += slot_s
            windows += 1
            for res in done:
                goal.observe(res)
                finished.append(res)
        aborted = [self._result(req, tokens, versions, "abort") for req, tokens, versions in self.running.values()]
        self.running.clear()
        return RoundRun(finished, aborted, started, self.clock.now() - start, busy, windows)

    @staticmethod
    def _result(req: GenRequest, tokens: list[int], versions: list[int], reason: str) -> GenResult:
        logprobs = list(req.resume_logprobs) + [-0.5 - 0.01 * v for v in versions[len(req.resume_tokens):]]
        return GenResult(req.request_id, tokens, logprobs, reason, versions,
                         req.submitted_version if req.submitted_version is not None else versions[0] if versions else 0)


def _make_request(engine: FakeEngine):
    def make(g: int, k: int, resume: GenResult | None) -> GenRequest:
        if resume is None:
            return GenRequest(f"g{g}/p{g}/{k}", [1, 2], max_tokens=200, submitted_version=engine.version)
        return GenRequest(resume.request_id, [1, 2], 200, resume.response_tokens, resume.logprobs,
                          resume.token_versions, resume.submitted_version)
    return make


def _targets(seed: int, n: int = 400) -> dict[int, int]:
    rng = random.Random(seed)
    return {g: 4 + (rng.randint(0, 8) if rng.random() < 0.7 else rng.randint(20, 120)) for g in range(n)}


def _scheduler(engine: FakeEngine, clock: VirtualClock, mode: str, **kw) -> SortedScheduler:
    return SortedScheduler(groups_per_step=4, samples_per_group=2, oversubscription=2.0, mode=mode,
                           make_request=_make_request(engine), clock=clock, **kw)


@pytest.mark.parametrize("max_sequences", [64, 5])  # 5 slots: most of the queue never starts (lazy loading)
@pytest.mark.parametrize("mode", ["partial", "on_policy"])
def test_rounds_lose_and_duplicate_no_prompt_across_aborts_and_restarts(tmp_path: Path, mode: str,
                                                                        max_sequences: int) -> None:
    clock = VirtualClock()
    engine = FakeEngine(clock, _targets(1), max_sequences=max_sequences)
    sched = _scheduler(engine, clock, mode)
    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    trained: Counter[int] = Counter()
    for round_index in range(30):
        if round_index in (7, 19):  # a restart: a new scheduler from the persisted cache
            rows = store.query("SELECT * FROM rollout_cache WHERE round = "
                               "(SELECT MAX(round) FROM rollout_cache)").to_pylist()
            from reflow.storage.schema import CachedSample

            sched = _scheduler(engine, clock, mode)
            sched.restore([CachedSample(**r) for r in rows])
        result = sched.run_round(engine)
        assert all(len(v) == 2 for v in result.trainable.values())
        if mode == "partial":
            assert len(result.trainable) == 4
        else:  # on_policy trains every complete group at once, at least one step's worth
            assert len(result.trainable) >= 4 and not any(len(st.finished) == 2 for st in sched.groups.values())
        trained.update(result.trainable.keys())
        engine.version += 1
        store.append_cache(sched.snapshot("run", round_index), app_id="run:rollout_cache", txn_version=round_index)
        # cache-aware loading: everything cached is older than every prompt never loaded
        assert all(g < sched.next_group for g in sched.groups)
        # a prompt is loaded only when one of its samples reached the engine
        assert {int(r.request_id.split("/")[0][1:]) for r in engine.submitted} == set(range(sched.next_group))
    assert max(trained.values()) == 1, "a prompt was trained twice"
    loaded = set(range(sched.next_group))
    assert set(trained) | set(sched.groups) == loaded, "a prompt was lost"
    assert not set(trained) & set(sched.groups)


@pytest.mark.parametrize("mode", ["partial", "on_policy"])
def test_a_round_killed_between_its_trajectories_and_its_snapshot_is_settled(mode: str) -> None:
    """The round's groups are written, its snapshot is not: restored from the one before, settled, none doubled."""
    clock = VirtualClock()
    engine = FakeEngine(clock, _targets(3), max_sequences=5)  # few slots: rounds open new prompts as they go
    sched = _scheduler(engine, clock, mode)
    trained: Counter[int] = Counter()
    snapshot = []
    for round_index in range(6):
        trained.update(sched.run_round(engine).trainable.keys())
        engine.version += 1
        snapshot = sched.snapshot("run", round_index)
    lost = sched.run_round(engine).trainable.keys()  # written to Delta; the kill lands before its snapshot
    trained.update(lost)
    sched = _scheduler(engine, clock, mode)
    sched.restore(snapshot)
    assert set(lost) & (set(sched.groups) | set(range(sched.next_group, max(lost) + 1))), "nothing to settle"
    sched.settle(set(lost))
    for _ in range(15):
        trained.update(sched.run_round(engine).trainable.keys())
        engine.version += 1
    assert max(trained.values()) == 1, "a prompt was trained twice"
    assert set(trained) | set(sched.groups) == set(range(sched.next_group)), "a prompt was skipped"
    assert not set(trained) & set(sched.groups)


def test_partial_mode_resumes_with_each_tokens_own_version_and_logprob() -> None:
    clock = VirtualClock()
    engine = FakeEngine(clock, _targets(2))
    sched = _scheduler(engine, clock, "partial")
    spanning = 0
    for _ in range(15):
        before = len(engine.submitted)
        result = sched.run_round(engine)
        engine.version += 1
        started = engine.submitted[before:]  # the round's prefill: prompts plus resumed prefixes
        assert result.stats.requests == len(started)
        assert result.stats.prefill_tokens == sum(len(r.prompt_tokens) + len(r.resume_tokens) for r in started)
        assert result.stats.resumed_tokens == sum(len(r.resume_tokens) for r in started)
        for samples in result.trainable.values():
            for r in samples:
                assert len(r.response_tokens) == len(r.logprobs) == len(r.token_versions)
                assert r.token_versions == sorted(r.token_versions)
                assert r.logprobs == [-0.5 - 0.01 * v for v in r.token_versions]  # logged when sampled
                spanning += len(set(r.token_versions)) > 1
    assert spanning > 0, "no sample was resumed across a weight update"
    resumed = [r for r in engine.submitted if r.resume_tokens]
    assert resumed and all(r.max_tokens == 200 for r in resumed)


def test_on_policy_mode_trains_only_single_version_samples_and_pins_starving_prompts() -> None:
    clock = VirtualClock()
    engine = FakeEngine(clock, {g: (150 if g == 3 else 6) for g in range(400)}, per_window=4)
    sched = _scheduler(engine, clock, "on_policy", max_aborts=2)
    seen_long = None
    for round_index in range(12):
        result = sched.run_round(engine)
        for samples in result.trainable.values():
            for r in samples:
                assert set(r.token_versions) == {engine.version}, "an on-policy sample is stale or spans versions"
        engine.version += 1
        if 3 in result.trainable:
            seen_long = round_index
    assert seen_long is not None and seen_long <= 3, "the long prompt starved"


def test_early_termination_sorting_and_bubble() -> None:
    clock = VirtualClock()
    targets = {g: (100 if g % 2 else 5) for g in range(100)}
    engine = FakeEngine(clock, targets)
    sched = _scheduler(engine, clock, "partial")
    result = sched.run_round(engine)
    assert sorted(result.trainable) == [0, 2, 4, 6]  # the four short groups, the long ones cached
    lengths = [sum(len(r.response_tokens) for r in v) for v in result.trainable.values()]
    assert lengths == sorted(lengths)
    assert result.stats.aborted == 8 and result.stats.cached_groups == 4 and result.stats.requests == 16
    assert result.stats.seconds == pytest.approx(0.1)  # two windows: ended early, long ones aborted
    assert 0 <= result.stats.bubble_ratio < 0.05

    # the plain-sync shape: a round that needs every group it opened (no oversubscription) waits for the
    # longest response, and the scheduler's own bubble shows the idle slots
    clock = VirtualClock()
    plain = FakeEngine(clock, targets)
    sync = SortedScheduler(groups_per_step=8, samples_per_group=2, oversubscription=1.0, mode="partial",
                           make_request=_make_request(plain), clock=clock)
    result = sync.run_round(plain)
    assert sorted(result.trainable) == list(range(8)) and result.stats.aborted == 0
    assert result.stats.bubble_ratio > 0.4


def test_snapshot_round_trip_and_bad_snapshot() -> None:
    clock = VirtualClock()
    engine = FakeEngine(clock, _targets(3))
    sched = _scheduler(engine, clock, "partial")
    sched.run_round(engine)
    rows = sched.snapshot("run", 0)
    other = _scheduler(engine, clock, "partial")
    other.restore(rows)
    assert other.next_group == sched.next_group and set(other.groups) == set(sched.groups)
    for g, st in sched.groups.items():
        assert other.groups[g].partial == st.partial and other.groups[g].finished == st.finished
        assert other.groups[g].aborts == st.aborts
    with pytest.raises(ValueError, match="marker"):
        other.restore(rows[1:])


def test_a_round_the_cache_already_fills_generates_nothing_and_has_no_bubble() -> None:
    clock = VirtualClock()
    engine = FakeEngine(clock, {g: 2 for g in range(100)}, per_window=4)  # every sample finishes in one window
    sched = SortedScheduler(groups_per_step=4, samples_per_group=2, oversubscription=4.0, mode="partial",
                            make_request=_make_request(engine), clock=clock)
    first = sched.run_round(engine)
    assert len(first.trainable) == 4 and len(sched._complete()) == 12  # 16 groups finished; 12 wait, finished
    submitted = len(engine.submitted)
    second = sched.run_round(engine)
    assert len(engine.submitted) == submitted, "the engine was given work the cache already held"
    assert second.stats.requests == 0 and second.stats.generated_tokens == 0 and second.stats.bubble_ratio == 0.0
    assert len(second.trainable) == 4 and set(second.trainable).isdisjoint(first.trainable)


def test_partial_mode_trains_long_groups_that_waited_before_newer_shorter_ones() -> None:
    """Complete groups that waited ``max_aborts`` rounds go first; the batch itself is still shortest first."""
    from reflow.control.sorted_rounds import GroupState

    clock = VirtualClock()
    engine = FakeEngine(clock, {})
    sched = _scheduler(engine, clock, "partial", max_aborts=2)

    lengths = {0: 90, 1: 60, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7}
    for g, length in lengths.items():
        st = GroupState(g, aborts=2 if g in (0, 1) else 0)  # groups 0 and 1 completed rounds ago and waited
        st.finished = {k: GenResult(f"g{g}/p{g}/{k}", [7] * length, [-0.5] * length, "stop", [0] * length, 0)
                       for k in range(2)}
        sched.groups[g] = st
    taken = sched._harvest()
    assert list(taken) == [2, 3, 1, 0]  # the two overdue ones, then the shortest; ordered by length
    assert all(sched.groups[g].aborts == 1 for g in (4, 5, 6))  # one more round in the cache


def test_partial_mode_never_pins_a_round_on_a_long_prompt_and_on_policy_does() -> None:
    targets = {g: (120 if g == 1 else 3) for g in range(1000)}
    for mode, waits in (("partial", False), ("on_policy", True)):
        clock = VirtualClock()
        engine = FakeEngine(clock, targets, per_window=4)
        sched = SortedScheduler(groups_per_step=4, samples_per_group=2, oversubscription=2.0, mode=mode,
                                make_request=_make_request(engine), clock=clock, max_aborts=2)
        longest = max(sched.run_round(engine).stats.seconds for _ in range(6))
        assert (longest >= 120 / 4 * 0.05) == waits, mode  # waiting for group 1 takes 30 windows



@pytest.mark.parametrize("mode", ["partial", "on_policy"])
@pytest.mark.parametrize("max_sequences", [64, 3])  # 3 slots each: the engines start new prompts out of order
def test_a_round_over_two_engines_loses_and_duplicates_no_prompt(mode: str, max_sequences: int) -> None:
    """Each group goes to engine ``position % 2``; every new prompt up to the last one started opens."""
    from reflow.control.sorted_rounds import PooledRoundEngine

    clock = VirtualClock()
    targets = _targets(2)
    engines = [FakeEngine(clock, targets, max_sequences=max_sequences) for _ in range(2)]
    pool = PooledRoundEngine(engines)
    assert pool.max_sequences == 2 * max_sequences
    sched = SortedScheduler(groups_per_step=4, samples_per_group=2, oversubscription=2.0, mode=mode,
                            make_request=_make_request(engines[0]), clock=clock)
    trained: Counter[int] = Counter()
    gaps = 0  # prompts opened in a round in which none of their samples started (a later prompt's did)
    for _ in range(25):
        before = sched.next_group
        result = sched.run_round(pool)
        started = {int(r.request_id.split("/")[0][1:]) for e in engines for r in e.submitted}
        gaps += sum(g not in started for g in range(before, sched.next_group))
        assert all(len(v) == 2 for v in result.trainable.values())
        assert len(result.trainable) >= 4 if mode == "on_policy" else len(result.trainable) == 4
        trained.update(result.trainable.keys())
        for engine in engines:
            engine.version += 1
        assert all(g < sched.next_group for g in sched.groups)
        for i, engine in enumerate(engines):  # the assignment by stream position
            assert {int(r.request_id.split("/")[0][1:]) % 2 for r in engine.submitted} <= {i}
    submitted = {int(r.request_id.split("/")[0][1:]) for e in engines for r in e.submitted}
    assert submitted <= set(range(sched.next_group)) and max(submitted) == sched.next_group - 1
    assert (gaps > 0) == (max_sequences == 3), gaps  # few slots: the engines do start prompts out of order
    assert max(trained.values()) == 1, "a prompt was trained twice"
    assert set(trained) | set(sched.groups) == set(range(sched.next_group)), "a prompt was lost"
    assert not set(trained) & set(sched.groups)


def test_a_goal_shared_by_two_engines_is_met_when_both_parts_are() -> None:
    from reflow.control.sorted_rounds import RoundGoal

    goal = RoundGoal({0: 2, 1: 2, 2: 1, 3: 2, 4: 0}, complete=1, groups_needed=4, pinned={3},
                     early_stop="groups", round_tokens=0, prefix={"g2/p2/0": 5, "g3/p3/1": 7})
    even, odd = goal.share({0, 2, 4}, 2), goal.share({1, 3}, 2)
    assert even.missing == {0: 2, 2: 1, 4: 0} and odd.missing == {1: 2, 3: 2}
    assert even.groups_needed == odd.groups_needed == 2  # ceil((4 - 1) / 2)
    assert even.pinned == set() and odd.pinned == {3}
    assert even.prefix == {"g2/p2/0": 5} and odd.prefix == {"g3/p3/1": 7}

    def done(g: int, k: int) -> GenResult:
        return GenResult(f"g{g}/p{g}/{k}", [7] * 3, [-0.5] * 3, "stop", [0] * 3, 0)

    # group 2 completes (even's), then 0 (even's): even has its two, the whole still needs 3 and its pin
    for result in (done(2, 2), done(0, 0), done(0, 1)):
        goal.observe(result)
        even.observe(result)
    assert even.met() and not odd.met() and not goal.met()
    goal.observe(done(1, 0))
    odd.observe(done(1, 0))  # group 1 still misses one sample
    assert not odd.met() and not goal.met()
    for result in (done(1, 1), done(3, 0)):  # 1 completes; pinned 3 still misses one
        goal.observe(result)
        odd.observe(result)
    assert not odd.met() and not goal.met()
    goal.observe(done(3, 1))
    odd.observe(done(3, 1))
    assert odd.met() and even.met() and goal.met()  # every part met: the whole is (4 + 1 complete >= 4)
    tokens = RoundGoal({0: 1, 1: 1}, complete=1, groups_needed=4, pinned=set(), early_stop="tokens",
                       round_tokens=101, prefix={})
    part = tokens.share({0}, 2)
    assert part.round_tokens == 51 and part.complete == 1  # the round already has its one complete group
