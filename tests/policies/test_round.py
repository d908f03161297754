"""``run_round``: the engine side of a length-aware round, against an in-process step engine."""

from __future__ import annotations

import random

from reflow.control.clock import VirtualClock
from reflow.control.sorted_rounds import RoundGoal, SortedScheduler
from reflow.policies.rounds import run_round
from reflow.storage.schema import GenRequest, GenResult, RoundRun


class StepEngine:
    """Each ``collect`` step decodes one token for up to ``max_sequences`` running requests (first come first)."""

    def __init__(self, lengths: dict[str, int], max_sequences: int) -> None:
        self.lengths, self.max_sequences, self.version = lengths, max_sequences, 0
        self.running: dict[str, tuple[GenRequest, list[int]]] = {}
        self.submitted: list[str] = []
        self.running_per_step: list[int] = []
        self.finished_per_step: list[list[GenResult]] = []

    def submit(self, requests) -> None:
        for r in requests:
            assert r.request_id not in self.running
            self.running[r.request_id] = (r, list(r.resume_tokens))
            self.submitted.append(r.request_id)

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        done = []
        active = list(self.running)[: self.max_sequences]
        self.running_per_step.append(len(active))
        for rid in active:
            req, tokens = self.running[rid]
            tokens.append(3)
            if len(tokens) >= self.lengths[rid]:
                del self.running[rid]
                done.append(self._result(req, tokens, "stop"))
        self.finished_per_step.append(done)
        return done

    def abort(self, request_ids) -> list[GenResult]:
        return [self._result(*self.running.pop(rid), "abort") for rid in request_ids]

    def snapshot(self, request_ids) -> list[GenResult]:
        return [self._result(*self.running[rid], "abort") for rid in request_ids]

    def num_unfinished(self) -> int:
        return len(self.running)

    def pending_ids(self) -> list[str]:
        return list(self.running)

    def _result(self, req: GenRequest, tokens: list[int], reason: str) -> GenResult:
        n = len(tokens)
        return GenResult(req.request_id, list(tokens), [-1.0] * n, reason, [self.version] * n, self.version)


def _queue(groups: int, samples: int) -> list[GenRequest]:
    return [GenRequest(f"g{g}/p{g}/{k}", [1, 2], 50) for g in range(groups) for k in range(samples)]


def _goal(groups: int, samples: int, needed: int, pinned: set[int] | None = None, **kw) -> RoundGoal:
    return RoundGoal({g: samples for g in range(groups)}, complete=0, groups_needed=needed, pinned=pinned or set(),
                     early_stop=kw.get("early_stop", "groups"), round_tokens=kw.get("round_tokens", 0),
                     prefix=kw.get("prefix", {}))


def test_the_engine_stays_full_from_the_queue_and_stops_in_the_step_that_meets_the_goal() -> None:
    # group g's samples take 2 + 3 * (g % 4) tokens; 4 slots, 12 groups of 2 queued, 3 groups needed
    queue = _queue(12, 2)
    lengths = {r.request_id: 2 + 3 * (int(r.request_id[1:].split("/")[0]) % 4) for r in queue}
    engine = StepEngine(lengths, max_sequences=4)
    run = run_round(engine, queue, _goal(12, 2, needed=3), max_sequences=4)
    assert engine.running_per_step == [4] * run.steps, "a slot stayed empty while work was queued"
    finished = {r.request_id for r in run.finished}
    complete = {g for g in range(12) if {f"g{g}/p{g}/0", f"g{g}/p{g}/1"} <= finished}
    assert len(complete) >= 3
    before_last = _goal(12, 2, needed=3)  # replayed up to the step before the last: not met yet
    for res in (r for step in engine.finished_per_step[:-1] for r in step):
        before_last.observe(res)
    assert not before_last.met(), "the engine stepped on after the goal was met"
    assert engine.submitted == [r.request_id for r in queue[: run.started]]  # taken from the front, in order
    assert run.started < len(queue), "requests that were never needed reached the engine"
    assert {r.request_id for r in run.aborted} | finished == set(engine.submitted)
    assert all(r.finish_reason == "abort" and len(r.response_tokens) < lengths[r.request_id] for r in run.aborted)
    assert not engine.running
    assert 0 < run.busy_slot_seconds <= 4 * run.seconds


def test_pinned_groups_hold_the_round_open_and_tokens_goal_counts_only_new_tokens() -> None:
    queue = _queue(6, 1)
    lengths = {r.request_id: (30 if r.request_id.startswith("g5/") else 2) for r in queue}
    run = run_round(StepEngine(lengths, 8), queue, _goal(6, 1, needed=2, pinned={5}), max_sequences=8)
    assert "g5/p5/0" in {r.request_id for r in run.finished} and not run.aborted

    goal = _goal(2, 1, needed=1, early_stop="tokens", round_tokens=10, prefix={"g0/p0/0": 8})
    goal.observe(GenResult("g0/p0/0", [3] * 9, [-1.0] * 9, "stop", [0] * 9, 0))  # 8 resumed + 1 new
    assert goal.complete == 1 and goal.generated == 1 and not goal.met()
    goal.observe(GenResult("g1/p1/0", [3] * 9, [-1.0] * 9, "stop", [0] * 9, 0))
    assert goal.generated == 10 and goal.met()


def test_a_goal_met_before_the_round_starts_submits_nothing() -> None:
    goal = RoundGoal({0: 0, 1: 2}, complete=1, groups_needed=1, pinned=set(), early_stop="groups", round_tokens=0,
                     prefix={})
    engine = StepEngine({}, 4)
    run = run_round(engine, _queue(2, 2)[2:], goal, max_sequences=4)
    assert run.started == 0 and run.steps == 0 and not engine.submitted and not run.finished and not run.aborted


def _resumed(res: GenResult) -> GenRequest:
    return GenRequest(res.request_id, [1, 2], 50, res.response_tokens, res.logprobs, res.token_versions,
                      res.submitted_version)


def test_a_parked_round_leaves_its_rest_running_and_the_next_round_continues_it_without_resubmitting() -> None:
    queue = _queue(4, 2)
    lengths = {r.request_id: (2 if r.request_id[1] in "01" else 12) for r in queue}
    lengths.update({f"g4/p4/{k}": 2 for k in range(2)})
    engine = StepEngine(lengths, max_sequences=8)
    run = run_round(engine, queue, _goal(4, 2, needed=2), max_sequences=8, park=True)
    parked = {r.request_id: r for r in run.aborted}
    assert set(parked) == set(engine.running) == {r.request_id for r in queue[4:]}
    assert all(r.finish_reason == "abort" and 0 < len(r.response_tokens) < 12 for r in parked.values())
    # the next round: the cache resumes all but one (that one is aborted), then a new group
    stray, *kept = sorted(parked)
    queue2 = [_resumed(parked[rid]) for rid in kept] + [GenRequest(f"g4/p4/{k}", [1, 2], 50) for k in range(2)]
    before = len(engine.submitted)
    run2 = run_round(engine, queue2, _goal(5, 2, needed=3), max_sequences=8)
    assert run2.continued == tuple(kept)
    assert engine.submitted[before:] == ["g4/p4/0", "g4/p4/1"], "a continued request was submitted again"
    assert stray not in engine.running and stray not in {r.request_id for r in run2.finished + run2.aborted}
    done = {r.request_id: r for r in run2.finished}
    assert set(kept) <= set(done) and all(len(done[rid].response_tokens) == 12 for rid in kept)
    assert not engine.running  # not parked this time: the rest was aborted


class _Rounds:
    """``RoundEngine`` over ``run_round`` and the step engine of the round tests (park honoured)."""

    def __init__(self, engine) -> None:
        self.engine, self.max_sequences = engine, engine.max_sequences

    def run_round(self, queue, goal) -> RoundRun:
        return run_round(self.engine, queue, goal, self.max_sequences, park=goal.park)


def test_parking_unfinished_responses_changes_what_is_prefilled_not_what_trains() -> None:
    rng = random.Random(3)
    targets = {g: 4 + (rng.randint(0, 8) if rng.random() < 0.7 else rng.randint(20, 120)) for g in range(200)}
    outcomes = {}
    for park in (False, True):
        lengths = {f"g{g}/p{g}/{k}": t for g, t in targets.items() for k in range(2)}
        engine = StepEngine(lengths, max_sequences=6)
        make = lambda g, k, resume: (GenRequest(f"g{g}/p{g}/{k}", [1, 2], 200) if resume is None else  # noqa: E731
                                     GenRequest(resume.request_id, [1, 2], 200, resume.response_tokens,
                                                resume.logprobs, resume.token_versions, resume.submitted_version))
        sched = SortedScheduler(groups_per_step=4, samples_per_group=2, oversubscription=2.0, mode="partial",
                                make_request=make, clock=VirtualClock(), park=park)
        trained, stats = [], []
        for _ in range(12):
            result = sched.run_round(_Rounds(engine))
            trained.append({g: [r.response_tokens for r in rs] for g, rs in result.trainable.items()})
            stats.append(result.stats)
        outcomes[park] = (trained, stats)
    (plain, plain_stats), (parked, parked_stats) = outcomes[False], outcomes[True]
    assert parked == plain
    assert [s.generated_tokens for s in parked_stats] == [s.generated_tokens for s in plain_stats]
    assert sum(s.continued for s in parked_stats) > 0 and sum(s.continued for s in plain_stats) == 0
    assert sum(s.resumed_tokens for s in parked_stats) == 0 < sum(s.resumed_tokens for s in plain_stats)
    for a, b in zip(parked_stats, plain_stats):
        assert a.resumed == b.resumed and a.prefill_tokens == b.prefill_tokens - b.resumed_tokens - 2 * a.continued
