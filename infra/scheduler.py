"""Length-aware rollout scheduling (SortedRL, arXiv 2603.23414), as plain control-plane code.

One round per trainer step:

1. **Cache-aware loading.** The round first resumes every cached partial
   response (prompt + tokens so far, each token keeping its log-prob and
   version) and restarts the unfinished samples of cached groups; new prompts
   (the next positions of the prompt stream) fill the rest of the round, so
   no new prompt enters while cached work waits and nothing starves.
2. **Oversubscription.** The round holds ``ceil(oversubscription *
   groups_per_step)`` groups, so the engine runs at a large batch.
3. **Early termination.** The engine is stepped in short windows until
   ``groups_per_step`` groups are complete (``early_stop = "groups"``) or
   ``round_tokens`` tokens were generated with at least one group complete
   (``"tokens"``); whatever is still running is aborted.
4. **Stateful cache.** ``partial``: every unfinished sample (and the finished
   samples of its group) stays in the cache and resumes next round.
   ``on_policy``: incomplete groups are dropped (no off-policy token is ever
   trained) and their prompts re-queued first in line; a prompt aborted
   ``max_aborts`` times is *pinned*: the next round does not end before it
   completes, so no prompt is lost.
5. **Length-sorted batches.** Complete groups are ordered by mean response
   length, shortest first (the micro-curriculum). ``partial``: the
   ``groups_per_step`` shortest train now, the rest wait, finished, in the
   cache. ``on_policy``: every complete group trains now (a batch can exceed
   ``groups_per_step`` by the groups that finished in the last window), so
   staleness is always 0. A group is trainable when all its samples are
   finished.

The rollout bubble ratio of a round is ``1 - busy_slot_seconds / (slots *
round_seconds)``: the share of engine slot-time with nothing to decode while
the round is open (``slots`` = sequences the engine can decode at once,
capped by the requests in the round).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

from reflow.infra.clock import Clock
from reflow.policies.engines import GenRequest, GenResult
from reflow.storage.schema import CachedSample

Mode = Literal["on_policy", "partial"]


@dataclass
class GroupState:
    """One prompt of the stream while it is in the cache."""

    group: int
    finished: dict[int, GenResult] = field(default_factory=dict)  # sample index -> finished result
    partial: dict[int, GenResult] = field(default_factory=dict)  # sample index -> aborted, tokens so far
    aborts: int = 0  # rounds that ended with this group incomplete


@dataclass(frozen=True)
class RoundStats:
    seconds: float
    generated_tokens: int  # tokens sampled in this round (resumed prefixes excluded)
    busy_slot_seconds: float
    slots: int
    requests: int
    resumed: int  # partial responses resumed in this round
    aborted: int  # requests aborted at the round's end
    cached_groups: int  # groups left in the cache after the round

    @property
    def bubble_ratio(self) -> float:
        capacity = self.slots * self.seconds
        return max(0.0, 1.0 - self.busy_slot_seconds / capacity) if capacity > 0 else 0.0


@dataclass(frozen=True)
class RoundResult:
    trainable: dict[int, list[GenResult]]  # group -> its samples, shortest groups first
    stats: RoundStats


class RoundEngine(Protocol):
    """What a round needs from the engine (an actor adapter or an in-process fake)."""

    max_sequences: int

    def submit(self, requests: Sequence[GenRequest]) -> None: ...

    def drain(self, window_s: float) -> tuple[list[GenResult], float]:
        """Step for about ``window_s``; (finished results, busy slot-seconds)."""
        ...

    def abort_all(self) -> tuple[list[GenResult], list[GenResult], float]:
        """Stop the round: (results that finished meanwhile, aborted partial results, their busy slot-seconds)."""
        ...


class SortedScheduler:
    """The rounds of one run; its state (``groups``, ``next_group``) is what the rollout cache persists."""

    def __init__(self, groups_per_step: int, samples_per_group: int, oversubscription: float, mode: Mode,
                 make_request: Callable[[int, int, GenResult | None], GenRequest], clock: Clock,
                 early_stop: Literal["groups", "tokens"] = "groups", round_tokens: int = 0, max_aborts: int = 2,
                 window_s: float = 0.05) -> None:
        if mode not in ("on_policy", "partial"):
            raise ValueError(f"mode must be 'on_policy' or 'partial', got {mode!r}")
        self.groups_per_step, self.samples = groups_per_step, samples_per_group
        self.round_groups = max(groups_per_step, math.ceil(oversubscription * groups_per_step))
        self.mode, self.make_request, self.clock = mode, make_request, clock
        self.early_stop, self.round_tokens, self.max_aborts, self.window_s = early_stop, round_tokens, max_aborts, window_s
        self.groups: dict[int, GroupState] = {}  # the cache, by stream position
        self.next_group = 0  # first prompt position never loaded

    def plan(self) -> list[GenRequest]:
        """The round's requests: cached work first (resumed partials, restarted samples), then new prompts."""
        requests = []
        for g in sorted(self.groups):
            st = self.groups[g]
            for k in range(self.samples):
                if k in st.finished:
                    continue
                resume = st.partial.get(k)
                requests.append(self.make_request(g, k, resume if resume and resume.response_tokens else None))
        while len(self.groups) < self.round_groups:
            g = self.next_group
            self.next_group += 1
            self.groups[g] = GroupState(g)
            requests += [self.make_request(g, k, None) for k in range(self.samples)]
        return requests

    def _complete(self) -> list[int]:
        return [g for g, st in self.groups.items() if len(st.finished) == self.samples]

    def _done(self, generated: int) -> bool:
        complete = set(self._complete())
        pinned = {g for g, st in self.groups.items() if st.aborts >= self.max_aborts}
        if not pinned <= complete:
            return False
        if self.early_stop == "tokens":
            return generated >= self.round_tokens and bool(complete)
        return len(complete) >= self.groups_per_step

    def run_round(self, engine: RoundEngine) -> RoundResult:
        """Load, generate until the threshold, abort the rest, hand out the shortest complete groups."""
        requests = self.plan()
        prefix = {r.request_id: len(r.resume_tokens) for r in requests}
        ids = {r.request_id: (g, k) for g, k, r in ((*self._key(r), r) for r in requests)}
        start = self.clock.now()
        engine.submit(requests)
        generated, busy, running = 0, 0.0, len(requests)
        while running and not self._done(generated):
            finished, slot_s = engine.drain(self.window_s)
            busy += slot_s
            for res in finished:
                g, k = ids[res.request_id]
                self.groups[g].finished[k] = res
                self.groups[g].partial.pop(k, None)
                generated += len(res.response_tokens) - prefix[res.request_id]
                running -= 1
        late, aborted, slot_s = engine.abort_all()
        busy += slot_s
        for res in late:  # finished in a window already under way when the round ended
            g, k = ids[res.request_id]
            self.groups[g].finished[k] = res
            self.groups[g].partial.pop(k, None)
            generated += len(res.response_tokens) - prefix[res.request_id]
        for res in aborted:
            g, k = ids[res.request_id]
            generated += len(res.response_tokens) - prefix[res.request_id]
            self.groups[g].partial[k] = res
        seconds = self.clock.now() - start
        trainable = self._harvest()
        stats = RoundStats(seconds=seconds, generated_tokens=generated, busy_slot_seconds=busy,
                           slots=min(len(requests), engine.max_sequences), requests=len(requests),
                           resumed=sum(1 for r in requests if r.resume_tokens), aborted=len(aborted),
                           cached_groups=len(self.groups))
        return RoundResult(trainable=trainable, stats=stats)

    def _harvest(self) -> dict[int, list[GenResult]]:
        """The shortest complete groups (up to one step's worth); incomplete ones per ``mode``."""
        def mean_length(g: int) -> float:
            return sum(len(r.response_tokens) for r in self.groups[g].finished.values()) / self.samples

        complete = sorted(self._complete(), key=lambda g: (mean_length(g), g))
        # partial: one step's worth now, the rest waits (finished) in the cache; on_policy: every complete
        # group trains now, so no sample is ever trained by weights newer than the ones that sampled it.
        now = complete if self.mode == "on_policy" else complete[: self.groups_per_step]
        taken = {}
        for g in now:
            finished = self.groups.pop(g).finished
            taken[g] = [finished[k] for k in range(self.samples)]
        for st in self.groups.values():
            if len(st.finished) == self.samples:
                continue
            st.aborts += 1
            if self.mode == "on_policy":  # nothing off-policy is kept: the prompt starts over
                st.finished.clear()
                st.partial.clear()
        return taken

    @staticmethod
    def _key(request: GenRequest) -> tuple[int, int]:
        """(group, sample) of a request id ``g<g>/<prompt id>/<k>``."""
        tag, _, k = request.request_id.rsplit("/", 2)
        return int(tag.removeprefix("g")), int(k)

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
