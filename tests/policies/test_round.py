"""``run_round``: the engine side of a length-aware round, against an in-process step engine."""

from __future__ import annotations

from reflow.infra.scheduler import RoundGoal
from reflow.policies.engines import GenRequest, GenResult
from reflow.policies.rounds import run_round


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
