"""The length-aware round (SortedRL) as a task: the scheduler (``control.sorted_rounds``), the engine actor, Delta.

The scheduler lives in the flow's process between rounds and is rebuilt
from the latest ``rollout_cache`` snapshot when it is not there (a restarted
run), so its cached partial responses survive a crash.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.control.clock import SystemClock
from reflow.control.sorted_rounds import PooledRoundEngine, RoundEngine, RoundGoal, SortedScheduler
from reflow.infra.placement import actor
from reflow.storage import queries
from reflow.storage.metrics import RolloutStats
from reflow.storage.schema import GenRequest, GenResult, RoundRun, group_stream_position, stream_tag
from reflow.tasks.context import TaskContext, context, mark_origin
from reflow.tasks.rollout import batch_stats, requests_for, scored_records, summary_of_written, written_before

_SCHEDULERS: dict[str, SortedScheduler] = {}


class RayRoundEngine:
    """``RoundEngine`` over the run's engine actor: the whole round is one actor call (``EngineWorker.run_round``)."""

    def __init__(self, handle: Any, max_sequences: int) -> None:
        self.handle, self.max_sequences = handle, max_sequences

    def run_round(self, requests: Sequence[GenRequest], goal: RoundGoal) -> RoundRun:
        return ray.get(self.handle.run_round.remote(list(requests), goal))


def _gather(parts: list[tuple[RayRoundEngine, list[GenRequest], RoundGoal]]) -> list[RoundRun]:
    """Every engine's part of a pooled round at once (``PooledRoundEngine``)."""
    return ray.get([engine.handle.run_round.remote(queue, goal) for engine, queue, goal in parts])


def round_engine(ctx: TaskContext) -> RoundEngine:
    """The run's main engines as one ``RoundEngine`` (``resources.engines``; flex workers take no part)."""
    max_sequences = ctx.cfg.rollout.max_concurrent_sequences
    engines = [RayRoundEngine(actor(name, ctx.record.namespace), max_sequences)
               for name in ctx.record.engines[:ctx.cfg.resources.engines]]
    return engines[0] if len(engines) == 1 else PooledRoundEngine(engines, _gather)


def _scheduler(ctx: TaskContext, run_dir: str) -> SortedScheduler:
    sched = _SCHEDULERS.get(run_dir)
    if sched is not None:
        return sched
    r = ctx.cfg.rollout

    @functools.lru_cache(maxsize=4 * math.ceil(r.oversubscription * r.prompts_per_step))
    def group_requests(g: int) -> list[GenRequest]:  # a group's prompt is tokenized once, not once per sample
        return requests_for(ctx, ctx.env.prompts("train", start=g, count=1), r.samples_per_prompt, stream_tag(g))

    def make_request(g: int, k: int, resume: GenResult | None) -> GenRequest:
        request = group_requests(g)[k]
        if resume is None:
            return request
        return GenRequest(request.request_id, request.prompt_tokens, request.max_tokens, resume.response_tokens,
                          resume.logprobs, resume.token_versions, resume.submitted_version)

    sched = SortedScheduler(groups_per_step=r.prompts_per_step, samples_per_group=r.samples_per_prompt,
                            oversubscription=r.oversubscription, mode=r.scheduling.removeprefix("sorted_"),
                            make_request=make_request, clock=SystemClock(), early_stop=r.early_stop,
                            round_tokens=r.round_tokens, max_aborts=r.max_aborts,
                            park=r.kv_on_update == "keep" and r.engine == "vllm")
    run_id = ctx.record.run_id
    snapshot = queries.latest_cache_snapshot(ctx.store, run_id)
    if snapshot:
        sched.restore(snapshot)
    # a round killed between its trajectories and its snapshot: its groups are written, the cache must not hold them
    lost_round = queries.groups_written_after(ctx.store, run_id, snapshot[0].round if snapshot else -1)
    sched.settle({group_stream_position(group) for group in lost_round})
    _SCHEDULERS[run_dir] = sched
    return sched


@task(name="rollout_sorted", cache_policy=NO_CACHE)
def sorted_round(run_dir: str, step: int) -> RolloutStats:
    """One SortedRL round: write the shortest complete groups for ``step`` and the cache snapshot to Delta."""
    ctx = context(run_dir)
    mark_origin(run_dir, ctx.clock.now())
    if written_before(ctx, step):  # a resumed run: the round and its cache snapshot are already in Delta
        return summary_of_written(ctx, step, ctx.clock.now())
    sched = _scheduler(ctx, run_dir)
    result = sched.run_round(round_engine(ctx))
    start = ctx.clock.now()
    items = []
    for g, samples in result.trainable.items():  # shortest groups first
        prompt = ctx.env.prompts("train", start=g, count=1)[0]
        tokens = list(ctx.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
        items += [(prompt, tokens, res) for res in samples]
    records = scored_records(ctx, step, items)
    app = ctx.record.run_id
    version = ctx.store.append_trajectories(records, app_id=f"{app}:trajectories", txn_version=step)
    ctx.store.append_cache(sched.snapshot(app, step), app_id=f"{app}:rollout_cache", txn_version=step)
    st = result.stats
    return RolloutStats(step=step, batch=batch_stats(records), samples=len(records),
                        generated_tokens=st.generated_tokens, rollout_seconds=st.seconds,
                        score_seconds=ctx.clock.now() - start, rollout_bubble_ratio=st.bubble_ratio,
                        resumed_requests=st.resumed, aborted_requests=st.aborted, cached_groups=st.cached_groups,
                        prefill_tokens=st.prefill_tokens, resumed_prefix_tokens=st.resumed_tokens,
                        continued_requests=st.continued, trajectories_delta_version=-1 if version is None else version)
