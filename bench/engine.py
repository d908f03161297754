"""``reflow bench-engine``: generated tokens/s of one engine at fixed numbers of running sequences.

SortedRL's bubble ratio is a share of engine slot-time; what it buys in
tokens/s depends on how a decode step's cost grows with the number of
sequences it decodes. On a GPU a step is bound by reading the weights, so a
full batch costs about what a small one does; on a CPU it is bound by
arithmetic and grows with the batch. This measures that curve directly.

For each concurrency ``c`` the engine is kept at exactly ``c`` running
requests (a finished request is replaced at once from a queue of workload
prompts, so prefills of new requests are included, as in a real round) for
``steps`` engine steps after ``warmup`` untimed ones. The figure is tokens
generated over the wall time of the timed steps, including the adds.

``measure_prefill`` times the other half of a round's work: ``count``
requests of ``prompt_tokens`` tokens each, one token generated, i.e. what a
partial rollout pays again when it resumes on new weights (its KV cache was
computed with the old ones, so prompt and partial response are prefilled
anew). The token order of each request is shuffled with its own seed, so
vLLM's prefix cache cannot serve one request from another.

``measure_pool`` times data-parallel generation (``resources.engines``): the
same fixed set of requests, dealt round-robin to N engine actors under Ray
that share the thread budget, for each N.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from reflow.config.schema import ReflowConfig
from reflow.envs.base import make_env
from reflow.infra.actors import EngineWorker
from reflow.infra.placement import quiet_token_auth_notice, worker_env
from reflow.policies.engines import engine_settings
from reflow.policies.models import load_tokenizer, resolve_model_dir
from reflow.policies.vllm_engine import VLLMEngine
from reflow.storage.schema import GenRequest


@dataclass(frozen=True)
class ConcurrencyPoint:
    concurrency: int
    steps: int
    seconds: float
    tokens: int
    tokens_per_s: float
    step_ms_median: float
    running_mean: float  # sequences decoded per timed step (should equal ``concurrency``)


def measure(engine: VLLMEngine, prompts: Sequence[list[int]], concurrency: int, max_tokens: int, steps: int,
            warmup: int, tag: str) -> ConcurrencyPoint:
    """Keep ``concurrency`` requests running for ``warmup + steps`` engine steps; time the last ``steps``."""
    if concurrency < 1 or steps < 1 or warmup < 0:
        raise ValueError("concurrency and steps must be >= 1, warmup >= 0")
    counter = itertools.count()
    source = itertools.cycle(prompts)
    running: set[str] = set()
    produced: dict[str, int] = {}

    def top_up() -> None:
        new = []
        while len(running) + len(new) < concurrency:
            rid = f"{tag}/{next(counter)}"
            new.append(GenRequest(rid, list(next(source)), max_tokens))
        engine.submit(new)
        running.update(r.request_id for r in new)

    step_s: list[float] = []
    sizes: list[int] = []
    tokens_at_start = 0
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            tokens_at_start, start = _generated(engine, produced), time.perf_counter()
        t0 = time.perf_counter()
        top_up()
        sizes.append(len(running))
        for result in engine.collect(1):
            running.discard(result.request_id)
            produced[result.request_id] = len(result.response_tokens)
        step_s.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    tokens = _generated(engine, produced) - tokens_at_start
    engine.abort(sorted(running))
    timed = sizes[warmup:]
    return ConcurrencyPoint(concurrency=concurrency, steps=steps, seconds=seconds, tokens=tokens,
                            tokens_per_s=tokens / max(seconds, 1e-9),
                            step_ms_median=1000 * statistics.median(step_s[warmup:]),
                            running_mean=statistics.fmean(timed))


def _generated(engine: VLLMEngine, produced: dict[str, int]) -> int:
    """Tokens generated so far: finished requests plus what the running ones hold."""
    return sum(produced.values()) + engine.tokens_in_flight()


def sweep(engine: VLLMEngine, prompts: Sequence[list[int]], concurrencies: Sequence[int], max_tokens: int,
          steps: int = 60, warmup: int = 10, progress: Callable[[str], None] = print) -> list[dict]:
    """``measure`` at each concurrency, in the given order; JSON-ready rows."""
    rows = []
    for c in concurrencies:
        point = measure(engine, prompts, c, max_tokens, steps, warmup, tag=f"c{c}")
        progress(f"  {c:>4} running: {point.tokens_per_s:8.0f} tokens/s, step {point.step_ms_median:6.1f} ms "
                 f"(median)")
        rows.append(asdict(point))
    return rows


def measure_prefill(engine: VLLMEngine, prompts: Sequence[list[int]], count: int, prompt_tokens: int,
                    tag: str) -> dict:
    """Prefill ``count`` requests of ``prompt_tokens`` tokens (1 token generated each); tokens/s of prompt."""
    if count < 1 or prompt_tokens < 1:
        raise ValueError("count and prompt_tokens must be >= 1")
    source = itertools.cycle(prompts)
    requests = []
    for i in range(count):
        tokens: list[int] = []
        while len(tokens) < prompt_tokens:
            tokens.extend(next(source))
        tokens = tokens[:prompt_tokens]
        random.Random(i).shuffle(tokens)
        requests.append(GenRequest(f"{tag}/{i}", tokens, max_tokens=1))
    start = time.perf_counter()
    engine.submit(requests)
    pending = {r.request_id for r in requests}
    while pending:
        for result in engine.collect(1):
            pending.discard(result.request_id)
    seconds = time.perf_counter() - start
    return {"requests": count, "prompt_tokens": prompt_tokens, "seconds": seconds,
            "prefill_tokens_per_s": count * prompt_tokens / max(seconds, 1e-9)}


def bench_engine(cfg: ReflowConfig, levels: Sequence[int], steps: int, warmup: int,
                 prefill_lengths: Sequence[int], progress: Callable[[str], None] = print) -> dict:
    """Tokens/s at each number of running sequences, then prefill rates; JSON-ready figures.

    The engine runs in this process with ``resources.torch_threads`` threads
    (set ``OMP_NUM_THREADS`` before torch loads, as the CLI does) on the
    workload's first 512 train prompts.
    """
    threads = cfg.resources.torch_threads
    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(cfg)
    settings = dataclasses.replace(engine_settings(cfg, model_dir), max_concurrent_sequences=max(levels))
    tokenizer = load_tokenizer(model_dir)
    env = make_env(cfg.env, cfg.run.seed, tokenizer)
    prompts = env.prompts("train", start=0, count=512)
    tokens = tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    progress(f"vLLM engine, {threads} thread(s), {cfg.env.kind} prompts, up to {cfg.rollout.max_response_tokens} "
             f"tokens per response; {steps} timed steps per point")
    engine = VLLMEngine(settings)
    rows = sweep(engine, tokens, levels, cfg.rollout.max_response_tokens, steps=steps, warmup=warmup,
                 progress=progress)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_first"] = row["tokens_per_s"] / max(base, 1e-9)
    progress(f"tokens/s relative to {rows[0]['concurrency']} running: "
             + ", ".join(f"{r['concurrency']}: {r['vs_first']:.2f}x" for r in rows))
    prefill = []
    for length in prefill_lengths:
        point = measure_prefill(engine, tokens, min(256, settings.max_concurrent_sequences), length, tag=f"p{length}")
        progress(f"  prefill {point['requests']} x {length} tokens: {point['prefill_tokens_per_s']:8.0f} prompt "
                 f"tokens/s ({point['seconds']:.2f} s)")
        prefill.append(point)
    return {"engine": "vllm", "threads": threads, "model_dir": model_dir, "points": rows, "prefill": prefill}


def measure_pool(cfg: ReflowConfig, counts: Sequence[int], requests: int,
                 progress: Callable[[str], None] = print) -> list[dict]:
    """Generated tokens/s of ``n`` vLLM engine actors splitting ``requests`` workload requests, for each ``n``.

    A local Ray with every core of the machine; each engine actor runs
    ``resources.torch_threads`` threads, as in a run, and reserves
    ``cores / n`` CPUs. With one thread per engine on a machine of several
    cores, more engines use more cores; where one engine's threads already
    fill the machine, the split buys nothing but overhead. Each point first
    generates one untimed request per engine, then times the whole set to
    completion (the wall time ends with the slowest engine).
    """
    import ray

    if not counts or min(counts) < 1 or requests < 1:
        raise ValueError("engine counts and requests must be >= 1")
    model_dir = resolve_model_dir(cfg)
    settings = engine_settings(cfg, model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = make_env(cfg.env, cfg.run.seed, tokenizer).prompts("train", start=0, count=requests)
    tokens = tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    cores = os.cpu_count() or 1
    quiet_token_auth_notice()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=True,
             logging_level="warning")
    rows = []
    try:
        for n in counts:
            threads = cfg.resources.torch_threads
            env = worker_env(threads, settings.enforce_eager)
            engines = [ray.remote(EngineWorker).options(num_cpus=cores / n, runtime_env={"env_vars": env}).remote(
                "vllm", dataclasses.replace(settings, threads=threads))
                for _ in range(n)]
            ray.get([e.generate.remote([GenRequest(f"warm{i}", tokens[0], 8)]) for i, e in enumerate(engines)])
            batch = [GenRequest(f"n{n}/{i}", list(t), cfg.rollout.max_response_tokens) for i, t in enumerate(tokens)]
            start = time.perf_counter()
            parts = ray.get([e.generate.remote(batch[i::n]) for i, e in enumerate(engines)])
            seconds = time.perf_counter() - start
            generated = sum(len(r.response_tokens) for part in parts for r in part.results)
            rows.append({"engines": n, "threads_per_engine": threads, "requests": requests, "tokens": generated,
                         "seconds": seconds, "tokens_per_s": generated / max(seconds, 1e-9),
                         "engine_seconds": [part.seconds for part in parts]})
            progress(f"  {n} engine(s) x {threads} thread(s): {rows[-1]['tokens_per_s']:8.0f} tokens/s "
                     f"({generated} tokens in {seconds:.1f} s)")
            for e in engines:
                ray.kill(e)
    finally:
        ray.shutdown()
    for row in rows:
        row["vs_first"] = row["tokens_per_s"] / max(rows[0]["tokens_per_s"], 1e-9)
    progress("tokens/s relative to " + f"{rows[0]['engines']} engine(s): "
             + ", ".join(f"{r['engines']}: {r['vs_first']:.2f}x" for r in rows))
    return rows
