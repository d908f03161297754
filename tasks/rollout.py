"""Rollout, scoring and evaluation tasks.

``rollout`` leaves the generated samples in Ray's object store and returns a
handle (an object reference plus counts); ``score`` turns them into scored
``Trajectory`` records and appends them to the ``trajectories`` table with an
application transaction ``(run_id:trajectories, step)``, so a retried step
writes nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from reflow.envs.base import Prompt, Score
from reflow.infra.placement import actor
from reflow.policies.engines import merge_batches
from reflow.storage.metrics import BatchStats, EvalStats, RolloutStats
from reflow.storage.schema import GenBatch, GenRequest, GenResult, SampleId, Trajectory
from reflow.storage.store import TRAJECTORIES
from reflow.tasks.context import TaskContext, context, mark_origin


@dataclass(frozen=True)
class RolloutHandle:
    """Where a round's samples will be (Ray object references to ``GenBatch`` parts, one per engine)."""

    step: int
    samples: Any  # [ray.ObjectRef[GenBatch]], one per engine that got requests
    num_requests: int
    submitted_at: float  # run clock when the round was submitted


def _train_prompts(ctx: TaskContext, step: int) -> list[Prompt]:
    per_step = ctx.cfg.rollout.prompts_per_step
    return ctx.env.prompts("train", start=step * per_step, count=per_step)


def requests_for(ctx: TaskContext, prompts: list[Prompt], samples: int, tag: str) -> list[GenRequest]:
    ids = ctx.tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    budget = ctx.cfg.rollout.max_response_tokens
    return [GenRequest(SampleId(tag, p.prompt_id, k).request_id, list(tok), budget)
            for p, tok in zip(prompts, ids) for k in range(samples)]


def written_before(ctx: TaskContext, step: int) -> bool:
    """Whether the trajectories of round ``step`` are already in Delta (written by an attempt that was killed)."""
    done = ctx.store.committed(TRAJECTORIES, f"{ctx.record.run_id}:trajectories")
    return done is not None and done >= step


def summary_of_written(ctx: TaskContext, step: int, start: float) -> RolloutStats:
    """The figures of a round already in Delta (its generation time was spent by the earlier attempt)."""
    rows = ctx.store.read_trajectories(run_id=ctx.record.run_id, rollout_step=step)
    batch = BatchStats.of(rows.column("reward").to_pylist(), rows.column("correct").to_pylist(),
                          rows.column("response_length").to_pylist())
    return RolloutStats(step=step, batch=batch, samples=rows.num_rows, generated_tokens=0, rollout_seconds=0.0,
                        score_seconds=ctx.clock.now() - start)


@task(name="rollout", cache_policy=NO_CACHE)
def rollout(run_dir: str, step: int) -> RolloutHandle:
    """Submit ``samples_per_prompt`` responses for each prompt of ``step``; returns at once.

    The engine actor generates in the background (with the weights it holds
    when it starts); ``score`` waits for the result. Calls queued on the
    actor (a weight sync) run after the round, in order.
    """
    ctx = context(run_dir)
    now = ctx.clock.now()
    mark_origin(run_dir, now)
    if written_before(ctx, step):  # a resumed run: a killed attempt already wrote this round
        return RolloutHandle(step=step, samples=None, num_requests=0, submitted_at=now)
    prompts = _train_prompts(ctx, step)
    names = ctx.record.engines
    if ctx.cfg.mode.kind == "one_step_off":  # its rollout overlaps the update, which the flex workers serve
        flex = set(ctx.cfg.resources.flex_indices)
        names = tuple(name for i, name in enumerate(names) if i not in flex)
    refs = []
    for i, name in enumerate(names):  # whole groups, dealt round-robin to the engines and flex workers
        requests = requests_for(ctx, prompts[i::len(names)], ctx.cfg.rollout.samples_per_prompt, str(step))
        if requests:
            refs.append(actor(name, ctx.record.namespace).generate.remote(requests))
    return RolloutHandle(step=step, samples=refs, num_requests=len(prompts) * ctx.cfg.rollout.samples_per_prompt,
                         submitted_at=now)


def _decode(ctx: TaskContext, result: GenResult) -> str:
    return ctx.tokenizer.decode(result.response_tokens, skip_special_tokens=True)


def scored_records(ctx: TaskContext, step: int, items: list[tuple[Prompt, list[int], GenResult]]) -> list[Trajectory]:
    """Scored records of ``(prompt, prompt tokens, result)`` items written at ``step``; one batched scoring call."""
    scores = ctx.env.score_many([p for p, _, _ in items], [_decode(ctx, r) for _, _, r in items])
    return [_record(ctx, step, p, toks, r, s) for (p, toks, r), s in zip(items, scores)]


def _record(ctx: TaskContext, step: int, prompt: Prompt, prompt_tokens: list[int], result: GenResult,
            score: Score) -> Trajectory:
    """The record of ``result`` with its ``score``, written at ``step``."""
    sample, run_id = SampleId.parse(result.request_id), ctx.record.run_id
    n = len(result.response_tokens)
    return Trajectory(
        trajectory_id=sample.trajectory_id(run_id), run_id=run_id, prompt_id=sample.prompt_id,
        group_id=sample.group_id(run_id), sample_index=sample.sample,
        env=prompt.env, rollout_step=step, policy_version=result.version, prompt_tokens=prompt_tokens,
        response_tokens=result.response_tokens, behaviour_logprobs=result.logprobs,
        token_versions=list(result.token_versions), loss_mask=result.mask(), reward=score.reward, correct=score.correct,
        finish_reason=result.finish_reason, response_length=n)


def batch_stats(records: list[Trajectory]) -> BatchStats:
    """Rewards and lengths of scored records."""
    return BatchStats.of([r.reward for r in records], [r.correct for r in records],
                         [r.response_length for r in records])


def tool_calls(loss_mask: list[int]) -> int:
    """Tool outputs in a response: runs of mask-0 tokens."""
    return sum(1 for i, m in enumerate(loss_mask) if m == 0 and (i == 0 or loss_mask[i - 1] == 1))


@task(name="score", cache_policy=NO_CACHE)
def score(run_dir: str, handle: RolloutHandle) -> RolloutStats:
    """Reward every sample and append the scored trajectories to Delta."""
    ctx = context(run_dir)
    if handle.samples is None:
        return summary_of_written(ctx, handle.step, ctx.clock.now())
    parts = ray.get(handle.samples)  # the main engines' parts first
    batch = merge_batches(parts)
    start = ctx.clock.now()
    results = batch.results
    prompts = {p.prompt_id: p for p in _train_prompts(ctx, handle.step)}
    prompt_tokens = dict(zip(prompts, ctx.tokenizer([p.text for p in prompts.values()],
                                                    add_special_tokens=False)["input_ids"]))
    pids = [SampleId.parse(res.request_id).prompt_id for res in results]
    records = scored_records(ctx, handle.step, [(prompts[pid], list(prompt_tokens[pid]), res)
                                          for pid, res in zip(pids, results)])
    version = ctx.store.append_trajectories(records, app_id=f"{ctx.record.run_id}:trajectories",
                                            txn_version=handle.step)
    return RolloutStats(step=handle.step, batch=batch_stats(records), samples=len(records),
                        generated_tokens=sum(r.response_length for r in records), rollout_seconds=batch.seconds,
                        score_seconds=ctx.clock.now() - start,
                        tool_calls=sum(tool_calls(r.loss_mask) for r in records) if ctx.cfg.tools.max_calls else None,
                        rollout_bubble_ratio=max(0.0, 1.0 - batch.busy_slot_seconds
                                                 / max(batch.slots * batch.seconds, 1e-9)),
                        prefill_tokens=sum(len(prompt_tokens[pid]) for pid in pids),
                        trajectories_delta_version=-1 if version is None else version)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(run_dir: str, step: int) -> EvalStats:
    """Accuracy on the held-out prompts, sampled like training (not stored), split over the main engines."""
    ctx = context(run_dir)
    start = ctx.clock.now()
    prompts = ctx.env.prompts("eval", start=0, count=ctx.cfg.env.eval_prompts)
    names = ctx.record.engines[:ctx.cfg.resources.engines]
    parts = [requests_for(ctx, prompts[i::len(names)], ctx.cfg.eval.samples_per_prompt, f"eval{step}")
             for i in range(len(names))]
    batches: list[GenBatch] = ray.get([actor(name, ctx.record.namespace).generate.remote(part)
                                       for name, part in zip(names, parts) if part])
    results = merge_batches(batches).results
    by_id = {p.prompt_id: p for p in prompts}
    scores = ctx.env.score_many([by_id[SampleId.parse(r.request_id).prompt_id] for r in results],
                                [_decode(ctx, r) for r in results])
    return EvalStats(step=step, eval_accuracy=float(np.mean([s.correct for s in scores])),
                     eval_reward_mean=float(np.mean([s.reward for s in scores])),
                     eval_response_length_mean=float(np.mean([len(r.response_tokens) for r in results])),
                     eval_seconds=ctx.clock.now() - start)
