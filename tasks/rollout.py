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
from reflow.infra.workers import actor
from reflow.policies.engines import GenBatch, GenRequest, GenResult
from reflow.storage.delta_store import TRAJECTORIES
from reflow.storage.schema import Trajectory
from reflow.tasks.context import TaskContext, context, mark_origin


@dataclass(frozen=True)
class RolloutHandle:
    """Where a round's samples will be (a Ray object reference to a ``GenBatch``)."""

    step: int
    samples: Any  # ray.ObjectRef[GenBatch]
    num_requests: int
    submitted_at: float  # run clock when the round was submitted


@dataclass(frozen=True)
class ScoreSummary:
    step: int
    delta_version: int | None  # None: already written by an earlier attempt
    num_samples: int
    reward_mean: float
    accuracy: float
    length_mean: float
    length_p50: float
    length_p99: float
    generated_tokens: int
    generation_seconds: float  # engine time spent on this round
    seconds: float
    bubble_ratio: float = 0.0  # share of engine slot-time idle while the round was open
    resumed: int = 0  # sorted rounds: partial responses resumed
    aborted: int = 0  # sorted rounds: requests aborted at the round's end
    cached_groups: int = 0  # sorted rounds: groups left in the rollout cache
    prefill_tokens: int = 0  # prompt tokens the engine prefilled (sorted rounds: resumed prefixes included)
    resumed_tokens: int = 0  # sorted rounds: resumed prefixes prefilled again
    tool_calls: int = 0  # tool outputs appended (multi-turn tool use)


@dataclass(frozen=True)
class EvalSummary:
    step: int
    accuracy: float
    reward_mean: float
    length_mean: float
    seconds: float


def _train_prompts(ctx: TaskContext, step: int) -> list[Prompt]:
    per_step = ctx.cfg.rollout.prompts_per_step
    return ctx.env.prompts("train", start=step * per_step, count=per_step)


def _requests(ctx: TaskContext, prompts: list[Prompt], samples: int, tag: str) -> list[GenRequest]:
    ids = ctx.tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    budget = ctx.cfg.rollout.max_response_tokens
    return [GenRequest(f"{tag}/{p.prompt_id}/{k}", list(tok), budget)
            for p, tok in zip(prompts, ids) for k in range(samples)]


def written_before(ctx: TaskContext, step: int) -> bool:
    """Whether the trajectories of round ``step`` are already in Delta (written by an attempt that was killed)."""
    done = ctx.store.committed(TRAJECTORIES, f"{ctx.record.run_id}:trajectories")
    return done is not None and done >= step


def summary_of_written(ctx: TaskContext, step: int, start: float) -> ScoreSummary:
    """The ``ScoreSummary`` of a round already in Delta (its generation time was spent by the earlier attempt)."""
    rows = ctx.store.read_trajectories(run_id=ctx.record.run_id, rollout_step=step)
    lengths = np.asarray(rows.column("response_length").to_pylist(), dtype=float)
    return ScoreSummary(step=step, delta_version=None, num_samples=rows.num_rows,
                        reward_mean=float(np.mean(rows.column("reward").to_pylist())),
                        accuracy=float(np.mean(rows.column("correct").to_pylist())),
                        length_mean=float(lengths.mean()), length_p50=float(np.percentile(lengths, 50)),
                        length_p99=float(np.percentile(lengths, 99)), generated_tokens=0,
                        generation_seconds=0.0, seconds=ctx.clock.now() - start)


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
    requests = _requests(ctx, _train_prompts(ctx, step), ctx.cfg.rollout.samples_per_prompt, str(step))
    ref = actor(ctx.record.engines[0], ctx.record.namespace).generate.remote(requests)
    return RolloutHandle(step=step, samples=ref, num_requests=len(requests), submitted_at=now)


def _decode(ctx: TaskContext, result: GenResult) -> str:
    return ctx.tokenizer.decode(result.response_tokens, skip_special_tokens=True)


def _records(ctx: TaskContext, step: int, items: list[tuple[Prompt, list[int], GenResult]]) -> list[Trajectory]:
    """Scored records of ``(prompt, prompt tokens, result)`` items written at ``step``; one batched scoring call."""
    scores = ctx.env.score_many([p for p, _, _ in items], [_decode(ctx, r) for _, _, r in items])
    return [_record(ctx, step, p, toks, r, s) for (p, toks, r), s in zip(items, scores)]


def _record(ctx: TaskContext, step: int, prompt: Prompt, prompt_tokens: list[int], result: GenResult,
            score: Score) -> Trajectory:
    """The record of ``result`` (request id ``<round>/<prompt id>/<sample>``) with its ``score``, written at ``step``."""
    tag, prompt_id, index = result.request_id.rsplit("/", 2)
    n = len(result.response_tokens)
    return Trajectory(
        trajectory_id=f"{ctx.record.run_id}/{tag}/{prompt_id}/{index}", run_id=ctx.record.run_id,
        prompt_id=prompt_id, group_id=f"{ctx.record.run_id}/{tag}/{prompt_id}", sample_index=int(index),
        env=prompt.env, rollout_step=step, policy_version=result.version, prompt_tokens=prompt_tokens,
        response_tokens=result.response_tokens, behaviour_logprobs=result.logprobs,
        token_versions=list(result.token_versions), loss_mask=result.mask(), reward=score.reward, correct=score.correct,
        finish_reason=result.finish_reason, response_length=n)


def tool_calls(loss_mask: list[int]) -> int:
    """Tool outputs in a response: runs of mask-0 tokens."""
    return sum(1 for i, m in enumerate(loss_mask) if m == 0 and (i == 0 or loss_mask[i - 1] == 1))


@task(name="score", cache_policy=NO_CACHE)
def score(run_dir: str, handle: RolloutHandle) -> ScoreSummary:
    """Reward every sample and append the scored trajectories to Delta."""
    ctx = context(run_dir)
    if handle.samples is None:
        return summary_of_written(ctx, handle.step, ctx.clock.now())
    batch: GenBatch = ray.get(handle.samples)
    start = ctx.clock.now()
    results = batch.results
    prompts = {p.prompt_id: p for p in _train_prompts(ctx, handle.step)}
    prompt_tokens = dict(zip(prompts, ctx.tokenizer([p.text for p in prompts.values()],
                                                    add_special_tokens=False)["input_ids"]))
    pids = [res.request_id.rsplit("/", 2)[1] for res in results]
    records = _records(ctx, handle.step, [(prompts[pid], list(prompt_tokens[pid]), res)
                                          for pid, res in zip(pids, results)])
    version = ctx.store.append_trajectories(records, app_id=f"{ctx.record.run_id}:trajectories",
                                            txn_version=handle.step)
    lengths = np.array([r.response_length for r in records], dtype=float)
    return ScoreSummary(step=handle.step, delta_version=version, num_samples=len(records),
                        reward_mean=float(np.mean([r.reward for r in records])),
                        accuracy=float(np.mean([r.correct for r in records])),
                        length_mean=float(lengths.mean()), length_p50=float(np.percentile(lengths, 50)),
                        length_p99=float(np.percentile(lengths, 99)), generated_tokens=int(lengths.sum()),
                        generation_seconds=batch.seconds, seconds=ctx.clock.now() - start,
                        tool_calls=sum(tool_calls(r.loss_mask) for r in records),
                        bubble_ratio=max(0.0, 1.0 - batch.busy_slot_seconds / max(batch.slots * batch.seconds, 1e-9)),
                        prefill_tokens=sum(len(prompt_tokens[pid]) for pid in pids))


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(run_dir: str, step: int) -> EvalSummary:
    """Accuracy on the held-out prompts, sampled like training (not stored)."""
    ctx = context(run_dir)
    start = ctx.clock.now()
    prompts = ctx.env.prompts("eval", start=0, count=ctx.cfg.env.eval_prompts)
    requests = _requests(ctx, prompts, ctx.cfg.eval.samples_per_prompt, f"eval{step}")
    batch: GenBatch = ray.get(actor(ctx.record.engines[0], ctx.record.namespace).generate.remote(requests))
    results = batch.results
    by_id = {p.prompt_id: p for p in prompts}
    scores = ctx.env.score_many([by_id[r.request_id.rsplit("/", 2)[1]] for r in results],
                                [_decode(ctx, r) for r in results])
    return EvalSummary(step=step, accuracy=float(np.mean([s.correct for s in scores])),
                       reward_mean=float(np.mean([s.reward for s in scores])),
                       length_mean=float(np.mean([len(r.response_tokens) for r in results])),
                       seconds=ctx.clock.now() - start)
