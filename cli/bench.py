"""``reflow bench``, ``bench-report``, ``bench-engine`` and ``bench-sampler``: the measurements."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from reflow.bench import decompose, mode_bench
from reflow.bench.sampler import bench_sampler, check_root
from reflow.cli.runtime import (
    MIN_FREE_MIB,
    check_writable,
    int_list,
    prefect_api_starting,
    preflight,
    quiet_environment,
)
from reflow.config.load import InputError, load_config


def cmd_bench_sampler(args: argparse.Namespace) -> int:
    if args.rows < 1000 or args.queries < 1:
        raise InputError("--rows must be >= 1000 and --queries >= 1")
    if not (8 <= args.rows_per_version <= args.rows and args.rows_per_version % 8 == 0):
        raise InputError(f"--rows-per-version must be a multiple of 8 (whole groups) between 8 and --rows, "
                         f"got {args.rows_per_version}")
    try:
        check_root(args.root, args.rebuild)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    check_writable(Path(args.root), "--root", 0)
    _check_output_dir(args.output)
    print(f"building/reusing {args.rows:,} trajectory rows under {args.root} ...", flush=True)
    figures = bench_sampler(args.rows, args.root, rows_per_version=args.rows_per_version, queries=args.queries,
                            rebuild=args.rebuild)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "bench_sampler.json").write_text(text)
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    levels = int_list(args.concurrency, "--concurrency")
    prefill_lengths = int_list(args.prefill_tokens, "--prefill-tokens")
    if prefill_lengths and min(prefill_lengths) < 1:
        raise InputError("--prefill-tokens values must be >= 1")
    if not levels or min(levels) < 1 or args.steps < 1 or args.warmup < 0:
        raise InputError("--concurrency values and --steps must be >= 1, --warmup >= 0")
    pool = int_list(args.engines, "--engines") if args.engines.strip() else []
    if pool and (min(pool) < 1 or args.pool_requests < 1):
        raise InputError("--engines values and --pool-requests must be >= 1")
    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.engine != "vllm":
        raise InputError("bench-engine measures the vLLM engine; set rollout.engine = \"vllm\"")
    _check_output_dir(args.output)
    quiet_environment(False)
    os.environ["OMP_NUM_THREADS"] = str(cfg.resources.torch_threads)  # as the engine actor runs (before torch loads)
    from reflow.bench.engine import bench_engine, measure_pool  # torch and vLLM, after OMP_NUM_THREADS is set

    figures = bench_engine(cfg, levels, args.steps, args.warmup, prefill_lengths,
                           progress=lambda line: print(line, flush=True))
    if pool:
        print(f"data-parallel engines: {args.pool_requests} requests dealt to each number of engines", flush=True)
        figures["pool"] = measure_pool(cfg, pool, args.pool_requests, progress=lambda line: print(line, flush=True))
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "bench_engine.json").write_text(json.dumps(figures, indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    known = ("sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if not modes or bad:
        raise InputError(f"--modes: unknown mode(s) {bad or modes}; choose from {', '.join(known)}")
    if len(set(modes)) < len(modes):
        raise InputError(f"--modes: a mode given twice in {args.modes!r}")
    seeds = int_list(args.seeds, "--seeds")
    if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
        raise InputError(f"--seeds: give one or more different seeds >= 0, got {args.seeds!r}")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        raise InputError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")
    if args.smooth_evals < 1:
        raise InputError(f"--smooth-evals must be >= 1, got {args.smooth_evals}")
    cfg = load_config(args.config, args.overrides)  # validate once, before any run starts
    preflight(cfg)
    if cfg.env.eval_prompts == 0:
        raise InputError("env.eval_prompts: the benchmark needs held-out prompts (> 0)")
    out = Path(args.output)
    _check_output_dir(args.output, MIN_FREE_MIB)
    try:  # every row's config and run directory, before any row runs
        mode_bench.check_rows(args.config, list(args.overrides), modes, seeds, out, args.equal_steps)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    quiet_environment(False)
    with prefect_api_starting():  # the flow imports (about 8 s) while the API server starts
        from reflow.flows.bench import bench_flow

    bench_flow(config=args.config, set=list(args.overrides), modes=modes, seeds=seeds, output=str(out.resolve()),
               target_accuracy=args.target_accuracy, smooth_evals=args.smooth_evals, equal_steps=args.equal_steps)
    return 0


def _check_output_dir(output: str | None, min_free_mib: int = 0) -> None:
    """InputError unless ``--output`` (if given) is a directory, or can be made one, and can be written."""
    if output is None:
        return
    if Path(output).exists() and not Path(output).is_dir():
        raise InputError(f"--output: {output!r} exists and is not a directory")
    check_writable(Path(output), "--output", min_free_mib)


def cmd_bench_report(args: argparse.Namespace) -> int:
    if args.output and (Path(args.output).is_dir() or not Path(args.output).parent.is_dir()):
        raise InputError(f"--output: {args.output!r} must be a file in an existing directory")
    results = []
    repeats: dict[str, list[str]] = {}  # repeat_key -> the invocations that ran it
    for item in args.dirs:
        path = Path(item)
        if not (path / "bench.json" if path.is_dir() else path).is_file():
            raise InputError(f"{item}: no bench.json there (run reflow bench --output {item} first)")
        try:
            runs = mode_bench.load_results(path)
            key = mode_bench.repeat_key(path)
        except ValueError as exc:
            raise InputError(str(exc)) from exc
        results += runs
        if key is not None and runs:
            invocation = mode_bench.invocation(runs[0])
            if invocation not in repeats.setdefault(key, []):
                repeats[key].append(invocation)
    if not any(r.mode in ("reflow", "sync") for r in results):
        raise InputError(f"no reflow or sync rows in {', '.join(args.dirs)}")
    report: dict = {}
    parts = []
    if any(r.mode == "reflow" for r in results):
        report = {**mode_bench.seed_speedups(results), "limits": decompose.speed_limits(results)}
        parts += [mode_bench.seed_table(report), decompose.limits_table(report["limits"])]
    if any(r.mode == "sync" for r in results):
        report["data"] = decompose.data_factors(results, list(repeats.values()))
        parts.append(decompose.data_table(report["data"]))
    print("\n\n".join(parts), flush=True)
    if args.output:
        tmp = Path(args.output).with_name(Path(args.output).name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(args.output)
    return 0
