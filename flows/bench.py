"""The benchmark flow: the same workload and seed under each mode, one after another.

Each mode runs as its own ``reflow run`` process (a fresh Ray, engine and
trainer, nothing warm carried from the previous mode) with
``eval.deferred`` on; ``bench.mode_bench`` turns the run directories into
``bench.json``, the table and the accuracy-vs-time PNG.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Literal

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from reflow.bench import decompose, mode_bench

ROWS = mode_bench.ROWS


@task(name="bench_mode", cache_policy=NO_CACHE)
def bench_mode(config: str | None, overrides: list[str], mode: str, seed: int, out: str, equal_data: bool) -> str:
    """Run one mode to completion in a child ``reflow run``; returns its run directory.

    ``equal_data``: the run ends after ``run.total_steps`` batches' worth of
    new groups, however many steps that takes (``mode_bench.equal_data``).
    """
    runs = Path(out) / "runs" / f"{mode}-s{seed}"
    if runs.exists() and any(runs.iterdir()):
        raise RuntimeError(f"{runs} is not empty; choose a new --output")
    cmd = [sys.executable, "-m", "reflow.cli.main", "run", "--runs", str(runs)]
    if config:
        cmd += ["--config", config]
    for item in mode_bench.row_overrides(config, overrides, mode, seed, equal_steps=not equal_data):
        cmd += ["--set", item]
    print(f"\n=== bench: mode {mode}, seed {seed} ===", flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        raise RuntimeError(f"mode {mode} seed {seed}: reflow run exited with code {code}")
    dirs = [d for d in runs.iterdir() if (d / "steps.jsonl").exists()]
    if len(dirs) != 1:
        raise RuntimeError(f"expected one run directory under {runs}, found {len(dirs)}")
    return str(dirs[0])


Mode = Literal["sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial"]


@flow(name="bench", log_prints=False)
def bench_flow(config: str | None, set: list[str], modes: list[Mode], seeds: list[int], output: str,
               target_accuracy: float | None = None, smooth_evals: int = 3, equal_steps: bool = False) -> dict:
    """All modes x seeds; writes ``output/bench.json`` and ``output/bench.png``; returns the summary.

    The parameters are ``reflow bench``'s flags.

    Args:
        config: the experiment file (--config).
        set: config fields changed for every mode, KEY=VALUE with a TOML value (--set), e.g. run.total_steps=20.
        modes: the modes to compare (--modes); sorted_* are sync mode with SortedRL rounds.
        seeds: one run per mode and seed (--seeds).
        output: the folder bench.json, bench.png and the runs are written to (--output).
        target_accuracy: held-out accuracy timed to (--target-accuracy); empty: the warm start plus 75% of
            sync's gain, per seed.
        smooth_evals: evaluations averaged when finding the target's crossing (--smooth-evals).
        equal_steps: give every mode run.total_steps steps instead of the same number of new groups
            (--equal-steps).
    """
    overrides, out, target, equal_data = set, output, target_accuracy, not equal_steps
    config_text = Path(config).read_text() if config else None  # kept in bench.json: what the runs read
    mode_bench.check_rows(config, overrides, modes, seeds, Path(out), equal_steps)  # before any row runs
    Path(out).mkdir(parents=True, exist_ok=True)
    results: list[mode_bench.ModeResult] = []
    for seed in seeds:
        for mode in modes:
            results.append(mode_bench.summarise(mode, seed, bench_mode(config, overrides, mode, seed, out, equal_data),
                                                None, smooth_evals))
    targets: dict[int, float] = {}
    for seed in seeds:
        sync = next((r for r in results if r.seed == seed and r.mode == "sync"), None)
        targets[seed] = target if target is not None else (
            mode_bench.default_target(sync) if sync
            else max(r.baseline_accuracy for r in results if r.seed == seed) + 0.1)
    results = [mode_bench.with_target(r, targets[r.seed]) for r in results]
    summary = mode_bench.aggregate(results)
    meta = {"config": config, "config_text": config_text,
            "overrides": overrides, "modes": modes, "seeds": seeds, "targets": targets,
            "target_rule": "given" if target is not None else "warm-start + 75% of sync's gain (per seed)",
            "smooth_evals": smooth_evals,
            "run_length": "equal data (run.total_steps batches of new groups)" if equal_data else "equal steps"}
    shares = mode_bench.by_share(results) if "sync" in modes else None
    speedups = mode_bench.seed_speedups(results) if "reflow" in modes and len(modes) > 1 else None
    limits = decompose.speed_limits(results) if speedups is not None else None
    mode_bench.write_json(Path(out) / "bench.json", results, summary, meta, shares, speedups, limits)
    mode_bench.plot(results, Path(out) / "bench.png")
    print("\n" + mode_bench.table(summary), flush=True)
    if shares is not None:
        print("\n" + mode_bench.share_table(shares), flush=True)
    if speedups is not None:
        print("\n" + mode_bench.seed_table(speedups), flush=True)
        print("\n" + decompose.limits_table(limits), flush=True)
    print(f"\ntargets: {targets}\nbench.json: {Path(out) / 'bench.json'}\nplot: {Path(out) / 'bench.png'}", flush=True)
    return summary
