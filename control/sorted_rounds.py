"""Length-aware rollout scheduling (SortedRL, arXiv 2603.23414), as plain control-plane code.

One round per trainer step:

1. **Cache-aware loading.** The round's queue starts with every cached
   partial response (prompt + tokens so far, each token keeping its log-prob
   and version) and the unfinished samples of cached groups; new prompts
   (the next positions of the prompt stream) come after them, so no new
   prompt starts while cached work waits and nothing starves.
2. **Oversubscription.** The queue holds at least ``ceil(oversubscription
   * groups_per_step) * samples_per_group`` requests, and the engine takes
   from its front into every slot that comes free, so it runs full until
   the round ends. Counting requests, not groups, matters in partial mode:
   cached groups miss only a few samples each. A new prompt is loaded (its
   stream position consumed) only when one of its samples starts.
3. **Early termination.** The engine steps until ``groups_per_step`` groups
   are complete (``early_stop = "groups"``) or ``round_tokens`` tokens were
   generated with at least one group complete (``"tokens"``); whatever is
   still running is aborted. The threshold (``RoundGoal``) travels with the
   requests and the engine checks it after every step, so a round is one
   call to the engine: no round trip per window, no step after the
   threshold is met.
4. **Stateful cache.** ``partial``: every unfinished sample (and the finished
   samples of its group) stays in the cache and resumes next round, first in
   the queue, so it always progresses and no round waits for it. With
   ``park`` (vLLM, ``rollout.kv_on_update = "keep"``) the unfinished ones are
   not aborted but left running in the engine with their KV cache; the cache
   still records their tokens, and the next round lets them go on instead of
   prefilling prompt + partial response again (``RoundStats.continued``).
   ``on_policy``: incomplete groups are dropped (no off-policy token is ever
   trained) and their prompts re-queued first in line; a prompt aborted
   ``max_aborts`` times is *pinned*: the next round does not end before it
   completes, so no prompt is lost (on-policy work restarts from nothing, so
   without the pin a long prompt could be aborted every round).
5. **Length-sorted batches.** Complete groups are ordered by mean response
   length, shortest first (the micro-curriculum). ``partial``: one step's
   worth trains now, groups that waited ``max_aborts`` rounds first, then
   the shortest; the rest wait, finished, in the cache (a round the cache
   already fills generates nothing). ``on_policy``: every complete group
   trains now (a batch can exceed ``groups_per_step``), so
   staleness is always 0. A group is trainable when all its samples are
   finished.

The rollout bubble ratio of a round is ``1 - busy_slot_seconds / (slots *
round_seconds)``: the share of engine slot-time with nothing to decode while
the round is open (``slots`` = sequences the engine can decode at once,
capped by the requests in the queue). A round is open, as a plain round is,
from the engine receiving its requests to the engine having aborted the
rest (``RoundRun.seconds``); the scheduler's own clock around the call
(``RoundStats.wall_seconds``) adds the transfer of requests and results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

from reflow.control.clock import Clock
from reflow.storage.schema import CachedSample, GenRequest, GenResult, RoundRun, SampleId

Mode = Literal["on_policy", "partial"]


@dataclass
class GroupState:
    """One prompt of the stream while it is in the cache."""

    group: int
    finished: dict[int, GenResult] = field(default_factory=dict)  # sample index -> finished result
    partial: dict[int, GenResult] = field(default_factory=dict)  # sample index -> aborted, tokens so far
    aborts: int = 0  # rounds that ended with this group in the cache (incomplete, or complete and waiting)


@dataclass(frozen=True)
class RoundStats:
    seconds: float  # the engine's, from receiving the round to having aborted its rest (RoundRun.seconds)
    wall_seconds: float  # the scheduler's, around the engine call (adds the transfer of requests and results)
    generated_tokens: int  # tokens sampled in this round (resumed prefixes excluded)
    busy_slot_seconds: float
    slots: int
    requests: int
    resumed: int  # partial responses resumed in this round
    aborted: int  # requests aborted at the round's end
    cached_groups: int  # groups left in the cache after the round
    prefill_tokens: int = 0  # tokens the engine had to prefill: every started request's prompt plus resumed prefix
    resumed_tokens: int = 0  # of which resumed prefixes (their KV cache was dropped with the old weights)
    continued: int = 0  # of the resumed, those still running in the engine with their KV cache (parked, no prefill)

    @property
    def bubble_ratio(self) -> float:
        capacity = self.slots * self.seconds
        if not self.requests or capacity <= 0:  # nothing was generated: the cache already held the batch
            return 0.0
        return max(0.0, 1.0 - self.busy_slot_seconds / capacity)


@dataclass(frozen=True)
class RoundResult:
    trainable: dict[int, list[GenResult]]  # group -> its samples, shortest groups first
    stats: RoundStats


class RoundGoal:
    """The threshold of one round, checked by the engine after every step (it travels to the engine actor).

    Built from the scheduler's state when the round starts: per group of the
    round, the samples it still misses; the groups already complete (partial
    mode keeps finished groups waiting); the pinned groups the round must
    not end without; and, for ``early_stop = "tokens"``, the resumed prefix
    of each resumed request (its tokens were generated in earlier rounds).
    """

    def __init__(self, missing: dict[int, int], complete: int, groups_needed: int, pinned: set[int],
                 early_stop: Literal["groups", "tokens"], round_tokens: int, prefix: dict[str, int],
                 park: bool = False) -> None:
        self.park = park  # leave unfinished requests running in the engine at the end (``run_round``)
        self.missing, self.complete, self.groups_needed = dict(missing), complete, groups_needed
        self.pinned = {g for g in pinned if self.missing.get(g, 0) > 0}
        self.early_stop, self.round_tokens, self.prefix = early_stop, round_tokens, prefix
        self.generated = 0  # tokens of finished samples sampled in this round
        self._prefix_by_group: dict[int, dict[str, int]] | None = None  # ``prefix`` by stream position (``share``)

    def observe(self, result: GenResult) -> None:
        g = SampleId.parse(result.request_id).stream_position
        self.generated += len(result.response_tokens) - self.prefix.get(result.request_id, 0)
        self.missing[g] -= 1
        if self.missing[g] == 0:
            self.complete += 1
            self.pinned.discard(g)

    def met(self) -> bool:
        if self.pinned:
            return False
        if self.early_stop == "tokens":
            return self.generated >= self.round_tokens and self.complete > 0
        return self.complete >= self.groups_needed

    def share(self, groups: set[int], parts: int) -> RoundGoal:
        """This goal's part for one of ``parts`` engines that generate ``groups`` (``PooledRoundEngine``).

        The part tracks only its groups; it needs ``ceil(1 / parts)`` of the
        completions the whole round still needs (``groups_needed`` minus the
        groups already complete) and of ``round_tokens``, and keeps the pins
        among its groups. Every part met means the whole goal is met (the
        parts' completions add up to at least what was missing), so the
        round ends when the slowest engine meets its part.
        """
        missing = {g: self.missing[g] for g in groups if g in self.missing}
        needed = math.ceil(max(0, self.groups_needed - self.complete) / parts)
        if self._prefix_by_group is None:  # parsed once for every part (a pool of 96 engines asks 96 times)
            self._prefix_by_group = {}
            for rid, n in self.prefix.items():
                self._prefix_by_group.setdefault(SampleId.parse(rid).stream_position, {})[rid] = n
        prefix = {rid: n for g in groups for rid, n in self._prefix_by_group.get(g, {}).items()}
        part = RoundGoal(missing, complete=0, groups_needed=needed, pinned=self.pinned & groups,
                         early_stop=self.early_stop, round_tokens=math.ceil(self.round_tokens / parts),
                         prefix=prefix, park=self.park)
        if self.early_stop == "tokens" and self.complete:
            part.complete = 1  # one complete group is all the tokens rule asks for, and the round has one
        return part


class RoundEngine(Protocol):
    """What a round needs from the engine (an actor adapter or an in-process fake)."""

    max_sequences: int

    def run_round(self, queue: Sequence[GenRequest], goal: RoundGoal) -> RoundRun:
        """Generate from the front of ``queue``, engine full, until ``goal.met()``; abort the rest
        (``policies.rounds.run_round``)."""
        ...


class PooledRoundEngine:
    """A round over several engines: each group's requests go to engine ``stream position % len(engines)``.

    The assignment is stable across rounds, so a response parked in an
    engine (``RoundGoal.park``) is continued by the same engine next round.
    Each engine gets its groups' requests in queue order and its share of
    the goal (``RoundGoal.share``); ``gather(parts)`` runs every ``(engine,
    queue, goal)`` part at once (a Ray adapter) or one after another (the
    default, for in-process engines), and the runs merge into one
    ``RoundRun`` with ``started_ids``: the round lasts as long as the slowest
    engine, and the slots add up.
    """

    def __init__(self, engines: Sequence[RoundEngine],
                 gather: Callable[[list[tuple[RoundEngine, list[GenRequest], RoundGoal]]],
                                  list[RoundRun]] | None = None,
                 ) -> None:
        if not engines:
            raise ValueError("a pooled round needs at least one engine")
        self.engines = list(engines)
        self.max_sequences = sum(e.max_sequences for e in self.engines)
        self.gather = gather or (lambda parts: [engine.run_round(q, g) for engine, q, g in parts])

    def run_round(self, queue: Sequence[GenRequest], goal: RoundGoal) -> RoundRun:
        n = len(self.engines)
        queues: list[list[GenRequest]] = [[] for _ in range(n)]
        groups: list[set[int]] = [set() for _ in range(n)]
        for request in queue:
            g = SampleId.parse(request.request_id).stream_position
            queues[g % n].append(request)
            groups[g % n].add(g)
        parts = [(engine, q, goal.share(g, n)) for engine, q, g in zip(self.engines, queues, groups) if q]
        runs = self.gather(parts)
        started: list[str] = []
        for (_, q, _), run in zip(parts, runs):
            started += [r.request_id for r in q[:run.started]]
        return RoundRun(finished=[r for run in runs for r in run.finished],
                        aborted=[r for run in runs for r in run.aborted], started=len(started),
                        seconds=max((run.seconds for run in runs), default=0.0),
                        busy_slot_seconds=sum(run.busy_slot_seconds for run in runs),
                        steps=max((run.steps for run in runs), default=0),
                        continued=tuple(rid for run in runs for rid in run.continued), started_ids=tuple(started))


class SortedScheduler:
    """The rounds of one run; its state (``groups``, ``next_group``) is what the rollout cache persists."""

    def __init__(self, groups_per_step: int, samples_per_group: int, oversubscription: float, mode: Mode,
                 make_request: Callable[[int, int, GenResult | None], GenRequest], clock: Clock,
                 early_stop: Literal["groups", "tokens"] = "groups", round_tokens: int = 0,
                 max_aborts: int = 2, park: bool = False) -> None:
        if mode not in ("on_policy", "partial"):
            raise ValueError(f"mode must be 'on_policy' or 'partial', got {mode!r}")
        self.groups_per_step, self.samples = groups_per_step, samples_per_group
        # groups open at once (cached ones included): bounds how far generation runs ahead of training
        self.round_groups = max(groups_per_step, math.ceil(oversubscription * groups_per_step))
        self.mode, self.make_request, self.clock = mode, make_request, clock
        self.early_stop, self.round_tokens, self.max_aborts = early_stop, round_tokens, max_aborts
        self.park = park and mode == "partial"  # unfinished responses stay in the engine (KV kept) till next round
        self.groups: dict[int, GroupState] = {}  # the cache, by stream position
        self.next_group = 0  # first prompt position never loaded

    def plan(self) -> tuple[list[GenRequest], list[int]]:
        """The round's queue and the new stream positions in it (in queue order).

        Cached work first (resumed partials, restarted samples), then the next
        prompts of the stream until ``round_groups`` groups are open. A new
        prompt is loaded only once the engine starts one of its samples
        (``run_round``), so planning changes nothing.
        """
        queue = []
        for g in sorted(self.groups):
            st = self.groups[g]
            for k in range(self.samples):
                if k in st.finished:
                    continue
                resume = st.partial.get(k)
                queue.append(self.make_request(g, k, resume if resume and resume.response_tokens else None))
        new = []
        while len(self.groups) + len(new) < self.round_groups:
            g = self.next_group + len(new)
            new.append(g)
            queue += [self.make_request(g, k, None) for k in range(self.samples)]
        return queue, new

    def _goal(self, queue: Sequence[GenRequest], new: Sequence[int]) -> RoundGoal:
        missing = {g: self.samples - len(st.finished) for g, st in self.groups.items()}
        missing.update((g, self.samples) for g in new)
        # on_policy only: an aborted on-policy sample starts over, so a long prompt could lose every round;
        # a partial one resumes where it stopped and is first in the next queue, so it always progresses
        pinned = ({g for g, st in self.groups.items() if st.aborts >= self.max_aborts}
                  if self.mode == "on_policy" else set())
        prefix = {r.request_id: len(r.resume_tokens) for r in queue if r.resume_tokens}
        return RoundGoal(missing, complete=sum(1 for m in missing.values() if m == 0),
                         groups_needed=self.groups_per_step, pinned=pinned, early_stop=self.early_stop,
                         round_tokens=self.round_tokens, prefix=prefix, park=self.park)

    def run_round(self, engine: RoundEngine) -> RoundResult:
        """Generate from the planned queue until the threshold, abort the rest, hand out the shortest complete
        groups."""
        queue, new = self.plan()
        ids = {r.request_id: self._key(r) for r in queue}
        start = self.clock.now()
        run = engine.run_round(queue, self._goal(queue, new))
        wall = self.clock.now() - start
        continued = set(run.continued)  # parked requests beyond ``run.started`` ran on as well
        if run.started_ids is None:
            started = queue[: run.started] + [r for r in queue[run.started:] if r.request_id in continued]
        else:  # several engines: each took a prefix of its own part of the queue
            taken = set(run.started_ids) | continued
            started = [r for r in queue if r.request_id in taken]
        prefilled = [r for r in started if r.request_id not in continued]
        opened = {ids[r.request_id][0] for r in started} & set(new)
        # One engine starts new prompts in stream order, so ``opened`` is a prefix of ``new``; several may start
        # a later one before an earlier one: every new prompt up to the last started opens (no gap in the stream).
        for g in (g for g in new if opened and g <= max(opened)):
            self.groups[g] = GroupState(g)
            self.next_group = g + 1
        prefix = {r.request_id: len(r.resume_tokens) for r in started}
        generated = 0
        for res in run.finished:
            g, k = ids[res.request_id]
            self.groups[g].finished[k] = res
            self.groups[g].partial.pop(k, None)
            generated += len(res.response_tokens) - prefix[res.request_id]
        for res in run.aborted:
            g, k = ids[res.request_id]
            generated += len(res.response_tokens) - prefix[res.request_id]
            self.groups[g].partial[k] = res
        trainable = self._harvest()
        stats = RoundStats(seconds=run.seconds, wall_seconds=wall, generated_tokens=generated,
                           busy_slot_seconds=run.busy_slot_seconds,
                           slots=min(len(queue), engine.max_sequences), requests=len(started),
                           resumed=sum(1 for r in started if r.resume_tokens), aborted=len(run.aborted),
                           cached_groups=len(self.groups),
                           prefill_tokens=sum(len(r.prompt_tokens) + len(r.resume_tokens) for r in prefilled),
                           resumed_tokens=sum(len(r.resume_tokens) for r in prefilled), continued=len(continued))
        return RoundResult(trainable=trainable, stats=stats)

    def _complete(self) -> list[int]:
        return [g for g, st in self.groups.items() if len(st.finished) == self.samples]

    def _harvest(self) -> dict[int, list[GenResult]]:
        """The complete groups to train now, shortest first; the rest per ``mode``.

        on_policy: every complete group, so no sample is ever trained by
        weights newer than the ones that sampled it. partial: one step's
        worth; groups that waited ``max_aborts`` rounds go first, then the
        shortest, so a long group is never starved by shorter ones finishing
        after it; the rest wait, finished, in the cache.
        """
        def mean_length(g: int) -> float:
            return sum(len(r.response_tokens) for r in self.groups[g].finished.values()) / self.samples

        complete = self._complete()
        if self.mode == "partial":
            overdue = lambda g: self.groups[g].aborts < self.max_aborts  # noqa: E731 (False sorts first)
            complete = sorted(complete, key=lambda g: (overdue(g), mean_length(g), g))[: self.groups_per_step]
        taken = {}
        for g in sorted(complete, key=lambda g: (mean_length(g), g)):
            finished = self.groups.pop(g).finished
            taken[g] = [finished[k] for k in range(self.samples)]
        for st in self.groups.values():
            st.aborts += 1
            if self.mode == "on_policy":  # nothing off-policy is kept: the prompt starts over
                st.finished.clear()
                st.partial.clear()
        return taken

    @staticmethod
    def _key(request: GenRequest) -> tuple[int, int]:
        """(stream position, sample index) of a request."""
        sample = SampleId.parse(request.request_id)
        return sample.stream_position, sample.sample

    # --- the rollout cache as rows (persisted in the ``rollout_cache`` Delta table) ---

    def snapshot(self, run_id: str, round_index: int) -> list[CachedSample]:
        """The cache after round ``round_index`` as ``rollout_cache`` rows (a marker row first)."""
        rows = [CachedSample(run_id=run_id, round=round_index, next_group=self.next_group, group_index=-1,
                             sample_index=-1, aborts=0, state="marker", request_id="", response_tokens=[],
                             behaviour_logprobs=[], token_versions=[], finish_reason="stop", submitted_version=0)]
        for g in sorted(self.groups):
            st = self.groups[g]
            kept = [("finished", k, r) for k, r in sorted(st.finished.items())]
            kept += [("partial", k, r) for k, r in sorted(st.partial.items())]
            if not kept:
                rows.append(CachedSample(run_id=run_id, round=round_index, next_group=self.next_group, group_index=g,
                                         sample_index=-1, aborts=st.aborts, state="pending", request_id="",
                                         response_tokens=[], behaviour_logprobs=[], token_versions=[],
                                         finish_reason="stop", submitted_version=0))
            for state, k, r in kept:
                rows.append(CachedSample(run_id=run_id, round=round_index, next_group=self.next_group, group_index=g,
                                         sample_index=k, aborts=st.aborts, state=state, request_id=r.request_id,
                                         response_tokens=list(r.response_tokens),
                                         behaviour_logprobs=list(r.logprobs), token_versions=list(r.token_versions),
                                         finish_reason=r.finish_reason, submitted_version=r.submitted_version))
        return rows

    def restore(self, rows: Sequence[CachedSample]) -> None:
        """Load the cache from the rows of one ``snapshot`` (the latest round's)."""
        markers = [r for r in rows if r.state == "marker"]
        if len(markers) != 1:
            raise ValueError(f"a rollout-cache snapshot has exactly one marker row, got {len(markers)}")
        self.next_group = markers[0].next_group
        self.groups = {}
        for r in rows:
            if r.state == "marker":
                continue
            st = self.groups.setdefault(r.group_index, GroupState(r.group_index, aborts=r.aborts))
            if r.state == "pending":
                continue
            result = GenResult(r.request_id, list(r.response_tokens), list(r.behaviour_logprobs), r.finish_reason,
                               list(r.token_versions), r.submitted_version)
            (st.finished if r.state == "finished" else st.partial)[r.sample_index] = result

    def settle(self, handed_out: set[int]) -> None:
        """Account for a round whose groups ``handed_out`` are in Delta but whose cache snapshot is not.

        A run killed between a round's two writes (its trajectories, then its
        cache snapshot) restores the snapshot before that round, which still
        holds (or has not yet opened) the groups the round handed out: run
        again, they would be written twice. Those groups leave the cache; the
        prompts the lost round opened before its newest handed-out group and
        did not hand out stay open (as pending groups, generated from nothing
        next), so the stream skips none and repeats none; every other cached
        group waited that round (``aborts``). The lost round's partial
        responses are lost work, not lost data: their samples are generated
        again.
        """
        if not handed_out:
            return
        for g in handed_out:
            self.groups.pop(g, None)
        for st in self.groups.values():
            st.aborts += 1
        newest = max(handed_out)
        for g in range(self.next_group, newest + 1):
            if g not in handed_out:
                self.groups[g] = GroupState(g)
        self.next_group = max(self.next_group, newest + 1)
