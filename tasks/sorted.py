"""The length-aware round (SortedRL) as a task: the scheduler in ``infra.scheduler``, the engine actor, Delta.

The scheduler lives in the flow's process between rounds and is rebuilt
from the latest ``rollout_cache`` snapshot when it is not there (a restarted
run), so its cached partial responses survive a crash.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np
import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.infra.clock import SystemClock
from reflow.infra.scheduler import RoundGoal, SortedScheduler
from reflow.infra.workers import actor
from reflow.policies.engines import GenRequest, GenResult
from reflow.policies.rounds import RoundRun
from reflow.storage.delta_store import ROLLOUT_CACHE
from reflow.storage.sampler import _quote
from reflow.storage.schema import CachedSample
from reflow.tasks.context import TaskContext, context, mark_origin
from reflow.tasks.rollout import ScoreSummary, _records, _requests, summary_of_written, written_before

_SCHEDULERS: dict[str, SortedScheduler] = {}


class RayRoundEngine:
    """``RoundEngine`` over the run's engine actor: the whole round is one actor call (``EngineWorker.run_round``)."""

    def __init__(self, handle: Any, max_sequences: int) -> None:
        self.handle, self.max_sequences = handle, max_sequences

    def run_round(self, requests: Sequence[GenRequest], goal: RoundGoal) -> RoundRun:
        return ray.get(self.handle.run_round.remote(list(requests), goal))


def _scheduler(ctx: TaskContext, run_dir: str) -> SortedScheduler:
    sched = _SCHEDULERS.get(run_dir)
    if sched is not None:
        return sched
    r = ctx.cfg.rollout

    @functools.lru_cache(maxsize=4 * math.ceil(r.oversubscription * r.prompts_per_step))
    def group_requests(g: int) -> list[GenRequest]:  # a group's prompt is tokenized once, not once per sample
        return _requests(ctx, ctx.env.prompts("train", start=g, count=1), r.samples_per_prompt, f"g{g}")

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
    run = _quote(ctx.record.run_id)
    if ctx.store.table_versions()[ROLLOUT_CACHE] >= 0:
        rows = ctx.store.query(f"SELECT * FROM {ROLLOUT_CACHE} WHERE run_id = {run} AND round = "
                               f"(SELECT MAX(round) FROM {ROLLOUT_CACHE} WHERE run_id = {run})").to_pylist()
        if rows:
            sched.restore([CachedSample(**row) for row in rows])
    _SCHEDULERS[run_dir] = sched
    return sched


@task(name="rollout_sorted", cache_policy=NO_CACHE)
def sorted_round(run_dir: str, step: int) -> ScoreSummary:
    """One SortedRL round: write the shortest complete groups for ``step`` and the cache snapshot to Delta."""
    ctx = context(run_dir)
    mark_origin(run_dir, ctx.clock.now())
    if written_before(ctx, step):  # a resumed run: the round and its cache snapshot are already in Delta
        return summary_of_written(ctx, step, ctx.clock.now())
    sched = _scheduler(ctx, run_dir)
    engine = RayRoundEngine(actor(ctx.record.engines[0], ctx.record.namespace), ctx.cfg.rollout.max_concurrent_sequences)
    result = sched.run_round(engine)
    start = ctx.clock.now()
    items = []
    for g, samples in result.trainable.items():  # shortest groups first
        prompt = ctx.env.prompts("train", start=g, count=1)[0]
        tokens = list(ctx.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
        items += [(prompt, tokens, res) for res in samples]
    records = _records(ctx, step, items)
    app = ctx.record.run_id
    version = ctx.store.append_trajectories(records, app_id=f"{app}:trajectories", txn_version=step)
    ctx.store.append_cache(sched.snapshot(app, step), app_id=f"{app}:rollout_cache", txn_version=step)
    lengths = np.array([r.response_length for r in records], dtype=float)
    st = result.stats
    return ScoreSummary(step=step, delta_version=version, num_samples=len(records),
                        reward_mean=float(np.mean([r.reward for r in records])),
                        accuracy=float(np.mean([r.correct for r in records])),
                        length_mean=float(lengths.mean()), length_p50=float(np.percentile(lengths, 50)),
                        length_p99=float(np.percentile(lengths, 99)), generated_tokens=st.generated_tokens,
                        generation_seconds=st.seconds, seconds=ctx.clock.now() - start,
                        bubble_ratio=st.bubble_ratio, resumed=st.resumed, aborted=st.aborted,
                        cached_groups=st.cached_groups, prefill_tokens=st.prefill_tokens,
                        resumed_tokens=st.resumed_tokens, continued=st.continued)
