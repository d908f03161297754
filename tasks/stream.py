"""Tasks and loop backends of the streaming modes (``async``, ``reflow``).

The control plane (``control.streaming``) drives two backends built here:
``RayFeeder`` (the engine actors and the appends, ``write_groups``) and
``RaySelector`` (the buffer's query, the ``start_update`` task and the weight push).
Group ``g`` of the stream is train prompt ``g`` (the same prompts, in the same
order, that the sync modes use), with round tag ``g<g>`` (``storage.schema.SampleId``).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import ray

from reflow.control.concurrency import ConcurrencyController
from reflow.control.feeder import Drained, Finished, Released
from reflow.control.roles import RolePool
from reflow.control.selector import StepOutcome
from reflow.control.state import LoopState
from reflow.control.streaming import StreamStart
from reflow.infra.placement import actor
from reflow.infra.run import append_given_up
from reflow.storage import queries
from reflow.storage.metrics import StepMetrics, StepTimes, StreamStats
from reflow.storage.replay import ReplayPolicy, ReplaySelection, replay_weight, select_batch
from reflow.storage.schema import GenRequest, GenResult, SampleId, group_stream_position, stream_tag
from reflow.storage.store import TRAJECTORIES, USAGE
from reflow.tasks.context import TaskContext, context, mark_origin, step_clock, step_control_cpu, step_cpu_idle
from reflow.tasks.rollout import requests_for, scored_records
from reflow.tasks.update import PendingUpdate, UpdateSummary, finish_update, prefetch_batch, push_weights, start_update

# Every decision of the elastic pool's scheduler, one JSON line each (``at``, ``worker``, ``role``, ``reason``,
# ``rates``), and every finished switch (``switched``: the worker, ``role``, ``seconds``), in the run directory
# and as an MLflow artifact.
ROLES_LOG = "roles.jsonl"


@dataclass(frozen=True)
class WriteSummary:
    chunk: int
    groups: int
    samples: int
    delta_version: int | None  # None: already written by an earlier attempt
    seconds: float


def group_of(request_id: str) -> int:
    """The stream position of a streaming request."""
    return SampleId.parse(request_id).stream_position


def write_groups(run_dir: str, chunk: int, finished: Sequence[Any]) -> WriteSummary:
    """Score whole groups (their ``GenResult``s) and append them as chunk ``chunk``.

    The append carries the application transaction ``(run_id:trajectories,
    chunk)``, so a retried chunk writes nothing twice. A plain call in the
    feeder's thread, not a Prefect task: a streaming step is one task run
    (docs/concepts.md "The control plane's CPU").
    """
    ctx = context(run_dir)
    start = ctx.clock.now()
    groups = sorted({group_of(r.request_id) for r in finished})
    prompts = {g: ctx.env.prompts("train", start=g, count=1)[0] for g in groups}
    tokens = dict(zip(groups, ctx.tokenizer([prompts[g].text for g in groups],
                                            add_special_tokens=False)["input_ids"]))
    records = scored_records(ctx, chunk, [(prompts[group_of(r.request_id)], list(tokens[group_of(r.request_id)]), r)
                                    for r in finished])
    version = ctx.store.append_trajectories(records, app_id=f"{ctx.record.run_id}:trajectories", txn_version=chunk)
    return WriteSummary(chunk=chunk, groups=len(groups), samples=len(records), delta_version=version,
                        seconds=ctx.clock.now() - start)


def stream_position(run_dir: str) -> StreamStart:
    """Where the feeder continues: after what a killed attempt wrote (groups in flight then are skipped)."""
    ctx = context(run_dir)
    done = ctx.store.committed(TRAJECTORIES, f"{ctx.record.run_id}:trajectories")
    if done is None:
        return StreamStart()
    groups = queries.written_groups(ctx.store, ctx.record.run_id)
    used = queries.trained_group_ids(ctx.store, ctx.record.run_id)
    unused = {group_stream_position(g): version for g, version in groups.items() if g not in used}
    return StreamStart(next_group=max(map(group_stream_position, groups), default=-1) + 1, next_chunk=done + 1,
                          written_groups=len(groups), unused=unused)


def trained_groups(run_dir: str, before_step: int) -> int:
    """Groups the usage log records as trained on by steps before ``before_step`` (``run.max_new_groups``)."""
    ctx = context(run_dir)
    return queries.trained_groups(ctx.store, ctx.record.run_id, before_step)


class PendingRequests:
    """The requests submitted to an engine actor and not finished yet, re-issued if the actor restarts.

    Ray restarts a dead engine actor and re-issues the calls that were in
    flight, but a restarted engine has lost the requests it was running; a
    drain answered by a new incarnation makes this re-submit them.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: dict[str, Any] = {}
        self.incarnation: str = ray.get(engine.incarnation.remote())
        self.reissued = 0
        # The engine's next window starts by giving back what it holds (a flex worker moving to training). Holding
        # nothing, with nothing on its way, it has nothing to give back: the ask lapses, or it would take the first
        # requests of the worker's next turn at generation away before it generated a token of them.
        self.release = False

    def submit(self, requests: Sequence[Any]) -> None:
        self.requests.update((r.request_id, r) for r in requests)
        self.engine.submit.remote(list(requests))

    def drained(self, drain: Any) -> Any:
        """Forget what ``drain`` finished or gave back; re-submit the rest if a restarted engine answered."""
        for res in (*drain.results, *drain.released):
            self.requests.pop(res.request_id, None)
        if not self.requests:
            self.release = False
        if drain.incarnation and drain.incarnation != self.incarnation:
            self.incarnation = drain.incarnation
            self.reissued += len(self.requests)
            self.engine.submit.remote(list(self.requests.values()))  # the engine skips ones it already runs
            print(f"engine actor restarted: re-issued {len(self.requests)} unfinished requests", flush=True)
        return drain

    def new_tokens(self, result: Any) -> int:
        """The tokens of ``result`` this engine generated: its response past what the request resumed from (a
        request another engine gave back carries that engine's tokens)."""
        request = self.requests.get(result.request_id)
        return len(result.response_tokens) - (len(request.resume_tokens) if request is not None else 0)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)


class RayFeeder:
    """``FeederBackend`` over the run's engine actors and ``write_groups``.

    The feeder deals each new group to an engine (``submit``'s ``engine``:
    the one with the most room below its own concurrency target), and every
    engine is drained on its own: ``wait_drain`` returns what the first
    engines to end their window finished, with each one's stepping seconds,
    and only those start a new window, so a slow engine (one whose core
    the trainer shares) never holds up the others.

    An engine whose window ends with requests still in flight starts its
    next window at once, before this process looks at what it finished:
    the engine then waits only for the call's round trip, not for the
    feeder's bookkeeping (new requests join it one window later). Without
    this, each engine stood still about 40 ms of every 250 ms window on this
    machine (generator idle 14%). ``keep_going`` (the loops still run) ends
    the chaining when the run stops.
    """

    def __init__(self, run_dir: str, keep_going: Callable[[], bool] = lambda: True) -> None:
        self.run_dir = run_dir
        self.keep_going = keep_going
        self.ctx: TaskContext = context(run_dir)
        self.engines = [actor(name, self.ctx.record.namespace) for name in self.ctx.record.engines]
        self.samples_per_group = self.ctx.cfg.rollout.samples_per_prompt
        self.last_write: WriteSummary | None = None
        self.pending = [PendingRequests(e) for e in self.engines]
        self._drains: dict[Any, int] = {}  # drain in progress -> engine index
        self._window_s = 0.25

    def submit(self, groups: Sequence[int], engine: int = 0) -> None:
        mark_origin(self.run_dir, self.ctx.clock.now())
        requests: list[Any] = []
        for g in groups:
            prompt = self.ctx.env.prompts("train", start=g, count=1)
            requests += requests_for(self.ctx, prompt, self.samples_per_group, stream_tag(g))
        if requests:
            self.pending[engine].submit(requests)  # actor calls run in order: before that engine's next drain

    def start_drain(self, window_s: float) -> Any:
        """Start a window on every engine with requests and none running; a handle while any runs."""
        self._window_s = window_s
        busy = set(self._drains.values())
        for i, (engine, pending) in enumerate(zip(self.engines, self.pending)):
            if i not in busy and pending.requests:
                self._drains[self._drain(i)] = i
        return self if self._drains else None

    def wait_drain(self, handle: Any) -> Drained:
        """What the engines whose window ended first finished (at least one); busy time per engine."""
        refs = list(self._drains)
        ready, rest = ray.wait(refs, num_returns=1)
        if rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        finished, busy, in_flight, released = [], {}, 0, []
        for ref in ready:
            i = self._drains.pop(ref)
            pending, drain = self.pending[i], ray.get(ref)
            # before ``drained`` forgets them: what each result holds beyond the request it was submitted as
            items = [Finished(group_of(r.request_id), r, pending.new_tokens(r), i) for r in drain.results]
            gave_back = [Released(group_of(r.request_id), self._resumed(i, r), i, pending.new_tokens(r))
                         for r in drain.released]
            pending.drained(drain)
            if drain.in_flight and self.keep_going():  # the next window first, then the bookkeeping
                self._drains[self._drain(i)] = i
            finished += items
            released += gave_back
            busy[i] = drain.seconds
            in_flight += drain.in_flight
        # Busy seconds are averaged over the engines, so tokens / busy is the pool's throughput.
        return Drained(finished=finished, busy_s=sum(busy.values()) / len(self.engines), in_flight=in_flight,
                       busy_by_engine=busy, released=released)

    def _drain(self, i: int) -> Any:
        """Start engine ``i``'s next window (giving back its requests first when ``release`` asked it to)."""
        release, self.pending[i].release = self.pending[i].release, False
        return self.engines[i].drain.remote(self._window_s, release=release)

    def _resumed(self, i: int, partial: GenResult) -> GenRequest:
        """The request engine ``i`` gave back, continuing after what it had generated."""
        return self.pending[i].requests[partial.request_id].resumed(partial)

    def release(self, engine: int) -> None:
        self.pending[engine].release = True

    def resubmit(self, requests: Sequence[Any], engine: int) -> None:
        self.pending[engine].submit(requests)

    def write(self, chunk: int, groups: dict[int, list[Finished]]) -> None:
        results = [f.result for g in sorted(groups) for f in groups[g]]
        self.last_write = write_groups(self.run_dir, chunk, results)

    def abandon(self, groups: Sequence[int]) -> None:
        drop = set(groups)
        for engine, pending in zip(self.engines, self.pending):
            ids = [rid for rid in pending.requests if group_of(rid) in drop]
            if ids:
                pending.forget(ids)  # never re-issued after an engine restart
                engine.abort.remote(ids)  # runs after the engine's current window

    def gave_up(self, finished: dict[int, list[Finished]]) -> None:
        append_given_up(self.run_dir, {g: [len(f.result.response_tokens) for f in items]
                                       for g, items in finished.items()})


@dataclass
class SelectorRecord:
    """Engine counters at the previous step (for per-step rates)."""

    engine_busy_s: float = 0.0
    generated_tokens: int = 0
    write_seconds: float = 0.0
    writes: int = 0
    engine_seconds: dict[int, float] = field(default_factory=dict)  # engine index -> its stepping seconds
    engine_tokens: dict[int, int] = field(default_factory=dict)  # engine index -> its tokens


class RaySelector:
    """``SelectorBackend`` over the trajectory tables, the trainer actor and the tracking tasks."""

    def __init__(self, run_dir: str, state: LoopState, controllers: Sequence[ConcurrencyController],
                 on_step: Any, replay: bool,
                 checkpoints: Any = lambda step: False, pool: RolePool | None = None) -> None:
        self.run_dir = run_dir
        self.pool = pool  # the flex workers' scheduler: the workers ready to train join each step
        self._decisions_logged = 0  # of pool.scheduler.decisions, those written to roles.jsonl
        self.ctx = context(run_dir)
        cfg = self.ctx.cfg
        b = cfg.buffer
        self.policy = ReplayPolicy(max_staleness_versions=b.max_staleness_versions,
                                   replay_ratio=b.replay_ratio if replay else 0.0,
                                   max_reuse=b.max_reuse if replay else 1, replay_order=b.replay_order,
                                   reuse_decay=b.reuse_decay, staleness_decay=b.staleness_decay)
        self.weight_fn = (lambda reuse, age: replay_weight(reuse, age, b.reuse_decay, b.staleness_decay))
        self.state, self.controllers, self.on_step = state, list(controllers), on_step
        self.checkpoints = checkpoints  # step -> whether recording it saves a checkpoint
        self.trainer = actor(self.ctx.record.trainer, self.ctx.record.namespace)
        self._weights: dict[int, Any] = {}  # version -> reference to its weights, taken as its step finished
        self.seen = SelectorRecord()
        # Where the selector's time goes between two updates (trainer idle), seconds; the log of step k is
        # known only after it, so each step reports the previous step's logging time.
        self.phase_s = {"select": 0.0, "push": 0.0, "log": 0.0}
        self._trained: dict[int, tuple[float, StepMetrics]] = {}  # trained, not recorded: (elapsed, figures)
        # A resumed run: steps up to this one were logged to usage by the killed attempt (the log is written as
        # the trainer starts a step, so the last may not have finished); they train again on their logged batches.
        self.recorded_until = self.ctx.store.committed(USAGE, f"{self.ctx.record.run_id}:usage")

    def select(self, step: int, trainer_version: int) -> ReplaySelection:
        started = self.ctx.clock.now()
        try:
            if self.recorded_until is not None and step <= self.recorded_until:
                recorded = queries.recorded_selection(self.ctx.store, self.ctx.record.run_id, step)
                if recorded is not None:
                    return recorded
            return select_batch(self.ctx.store, self.ctx.record.run_id, trainer_version,
                                self.ctx.cfg.rollout.prompts_per_step, self.policy, self.weight_fn,
                                samples_per_prompt=self.ctx.cfg.rollout.samples_per_prompt)
        finally:
            self.phase_s["select"] = self.ctx.clock.now() - started  # the last query of the step counts

    def consumed(self, selection: ReplaySelection) -> tuple[int, ...]:
        return tuple(sorted({group_stream_position(g) for g, kind in zip(selection.group_ids, selection.kinds)
                             if kind != "replay"}))

    def prefetch(self, selection: ReplaySelection) -> None:
        prefetch_batch(self.run_dir, selection)

    def start_train(self, step: int, selection: ReplaySelection) -> tuple[ReplaySelection, PendingUpdate]:
        helpers = [self.ctx.record.engines[i] for i in self.pool.ready()] if self.pool is not None else []
        return selection, start_update(self.run_dir, step, selection, helpers)

    def finish_train(self, handle: tuple[ReplaySelection, PendingUpdate], timeout: float | None) -> StepOutcome | None:
        selection, pending = handle
        updated = finish_update(self.run_dir, pending, timeout)
        if updated is None:
            return None
        step = pending.step
        # before any later call reaches the trainer: the push and the eval snapshot of this step use these
        self._weights[updated.version] = self.trainer.export_weights.remote()
        self._trained[step] = self._step_metrics(selection, updated)
        return StepOutcome(version=updated.version, groups=len(set(selection.group_ids)),
                           consumed=self.consumed(selection))

    def push_weights(self, version: int) -> None:
        started = self.ctx.clock.now()
        push_weights(self.run_dir, version, self._weights[version])
        self.phase_s["push"] = self.ctx.clock.now() - started

    def uses_trainer(self, step: int) -> bool:
        return bool(self.checkpoints(step))

    def record(self, step: int) -> None:
        elapsed, metrics = self._trained.pop(step)
        stream = dataclasses.replace(metrics.stream, select_seconds=self.phase_s["select"],
                                     push_seconds=self.phase_s["push"], previous_log_seconds=self.phase_s["log"])
        started = self.ctx.clock.now()
        self.on_step(step, elapsed, dataclasses.replace(metrics, stream=stream),
                     self._weights.pop(metrics.train.version))
        self.phase_s["log"] = self.ctx.clock.now() - started

    def _step_metrics(self, sel: ReplaySelection, updated: UpdateSummary) -> tuple[float, StepMetrics]:
        """(seconds since the training clock started, the step's figures): idle fractions, staleness, replay and
        concurrency of one streaming step."""
        elapsed, step_s = step_clock(self.run_dir, self.ctx.clock.now())
        step_s = max(step_s, 1e-9)
        driver_cpu, server_cpu = step_control_cpu(self.run_dir)
        with self.state.cond:
            busy, tokens = self.state.engine_busy_s, self.state.generated_tokens
            expired, abandoned = self.state.groups_expired, self.state.groups_abandoned
            write_s, writes = self.state.write_seconds, self.state.writes
            engine_s, engine_tokens = dict(self.state.engine_seconds), dict(self.state.engine_tokens)
        engine_rates = tuple(
            (engine_tokens.get(i, 0) - self.seen.engine_tokens.get(i, 0))
            / max(engine_s.get(i, 0.0) - self.seen.engine_seconds.get(i, 0.0), 1e-9)
            for i in range(len(self.controllers))) if len(self.controllers) > 1 else ()
        self.seen.engine_seconds, self.seen.engine_tokens = engine_s, engine_tokens
        busy_d, tokens_d = busy - self.seen.engine_busy_s, tokens - self.seen.generated_tokens
        self.seen.engine_busy_s, self.seen.generated_tokens = busy, tokens
        write_d, writes_d = write_s - self.seen.write_seconds, writes - self.seen.writes
        self.seen.write_seconds, self.seen.writes = write_s, writes
        kinds = Counter(sel.kinds)
        staleness = np.asarray(sel.staleness, dtype=float)
        reuse = np.asarray(sel.reuse_counts, dtype=float)
        train = updated.train
        times = StepTimes(
            step_seconds=step_s, update_seconds=updated.seconds,
            generator_idle_fraction=min(1.0, max(0.0, 1.0 - busy_d / step_s)),
            trainer_idle_fraction=min(1.0, max(0.0, 1.0 - train.trainer_seconds / step_s)),
            generated_tokens=tokens_d, generated_tokens_per_s=tokens_d / step_s,
            trained_tokens_per_s=train.trained_tokens / max(train.trainer_seconds, 1e-9),
            staleness_mean=float(staleness.mean()) if staleness.size else 0.0,
            staleness_max=int(staleness.max()) if staleness.size else 0, policy_version=updated.version,
            samples=len(sel.trajectory_ids), machine_cpu_idle_fraction=step_cpu_idle(self.run_dir),
            driver_cpu_fraction=driver_cpu, prefect_server_cpu_fraction=server_cpu,
            sync_weights_bytes=self.ctx.record.weight_bytes or None,
            usage_delta_version=updated.usage_delta_version if updated.usage_delta_version is not None else -1)
        stream = StreamStats(
            engine_tokens_per_s=tokens_d / max(busy_d, 1e-9), replay_share=sel.replay_share,
            reuse_mean=float(reuse.mean()) if reuse.size else 0.0, reuse_max=float(reuse.max()) if reuse.size else 0.0,
            fresh_samples=kinds["fresh"], stale_samples=kinds["stale"], replayed_samples=kinds["replay"],
            concurrency_target=sum(c.target for c in self.controllers), groups_expired=expired,
            groups_abandoned=abandoned, write_seconds=write_d, writes=writes_d,
            concurrency_target_by_engine=tuple(c.target for c in self.controllers) if len(self.controllers) > 1 else (),
            engine_tokens_per_s_by_engine=engine_rates,
            staleness_hist=tuple(int(np.sum(staleness == age))
                                 for age in range(self.policy.max_staleness_versions + 1)),
            **self._pool_figures())
        return elapsed, StepMetrics(batch=train.batch, train=train, times=times, stream=stream)

    def _pool_figures(self) -> dict[str, Any]:
        """The elastic pool's step figures (``StreamStats.role_*``), its new decisions appended to roles.jsonl."""
        if self.pool is None:
            return {}
        decisions = self.pool.scheduler.decisions[self._decisions_logged:]
        self._decisions_logged += len(decisions)
        finished = self.pool.finished_switches()
        flex = list(self.ctx.cfg.resources.flex_indices)
        lines = [{"at": d.at, "workers": list(d.workers), "role": d.role, "reason": d.reason,
                  "rates": dataclasses.asdict(d.rates)} for d in decisions]
        lines += [{"switched": flex.index(engine), "role": role, "seconds": seconds}
                  for engine, role, seconds in finished]
        if lines:
            with open(Path(self.run_dir) / ROLES_LOG, "a") as out:
                out.writelines(json.dumps(line) + "\n" for line in lines)
        f = self.pool.figures(finished)
        return {"role_generators": f.generators, "role_trainers": f.trainers, "role_switches": f.switches,
                "switch_seconds": f.switch_seconds, "requests_moved": self.state.requests_moved}
