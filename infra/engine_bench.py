"""``reflow bench-engine``: the engine throughput sweep (``policies.engine_bench``) on a config's model and prompts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from reflow.infra.config import ReflowConfig


def bench_engine(cfg: ReflowConfig, levels: Sequence[int], steps: int, warmup: int,
                 prefill_lengths: Sequence[int], progress: Callable[[str], None] = print) -> dict:
    """Tokens/s at each number of running sequences, then prefill rates; JSON-ready figures.

    The engine runs in this process with ``resources.torch_threads`` threads
    (set ``OMP_NUM_THREADS`` before torch loads, as the CLI does) on the
    workload's first 512 train prompts.
    """
    import torch

    from reflow.policies.engine_bench import measure_prefill, sweep
    from reflow.policies.engines import VLLMEngine
    from reflow.tasks.context import _env, _tokenizer
    from reflow.tasks.lifecycle import _engine_settings, resolve_model_dir

    threads = cfg.resources.torch_threads
    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(cfg)
    settings = dataclasses.replace(_engine_settings(cfg, model_dir), max_concurrent_sequences=max(levels))
    env = _env(cfg.env.model_dump_json(), cfg.run.seed, model_dir)
    prompts = env.prompts("train", start=0, count=512)
    tokens = _tokenizer(model_dir)([p.text for p in prompts], add_special_tokens=False)["input_ids"]
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
