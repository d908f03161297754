"""Side-by-side figures of the modes: per-run summaries, the table, the PNG.

Every mode runs the same config, workload and seed on the same resources,
one after another, each in its own ``reflow run`` process, with
``eval.deferred`` on, so the training clock of every mode excludes
evaluation and start-up. The time axis is the run's ``elapsed_s``: seconds
since its first rollout was submitted.

Time to target: the first eval point whose held-out accuracy reaches the
target, linearly interpolated between it and the previous eval point (the
warm-start evaluation is the point at t=0). The default target is the
warm-start accuracy plus 75% of what ``sync`` gained by its end (same seed),
so "time to target" reads "time to most of sync's improvement".

Smoothing (``smooth_evals`` = k, ``reflow bench --smooth-evals``): one
evaluation of 128 prompts x 4 samples is noisy (about +-0.02 to 0.03), so
with k > 1 time to target and the default target are read off the trailing
mean of the last k eval points (point i averages points i-k+1..i; the first
points average what there is, the warm start included), and final accuracy
is the mean of the last k evaluations. A trailing mean only crosses once the
evaluations already made say so: it delays every mode by the same number of
eval points, never credits a mode with a lucky single evaluation. The raw
curve is kept (``eval_curve``, ``final_accuracy_last``).

Data and speed, apart (``data_curve``): the same evaluations against the
new samples trained on so far (samples trained on for the first time; a
replayed sample counts once). ``samples_to_target`` is read off that curve
with the same smoothing, so time to target splits exactly into
``samples_to_target / new_samples_per_s_to_target``: how much new data a
mode needs to reach the target (what replay, staleness and batch shape buy
or cost in learning) and how fast it trains on new data until then (what
the engines and the overlap buy). A speedup between two modes is the
product of the two ratios.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from reflow.config.load import format_errors, load_config
from reflow.infra.run import read_steps
from reflow.storage.metrics import StepRecord, eval_points


@dataclass(frozen=True)
class ModeResult:
    """One mode's run, summarised."""

    mode: str
    seed: int
    run_dir: str
    steps: int
    wall_s: float  # training clock at the last step
    baseline_accuracy: float
    final_accuracy: float
    target_accuracy: float | None
    time_to_target_s: float | None  # None: never reached
    generated_tokens_per_s: float  # all tokens generated / wall_s
    engine_tokens_per_s: float  # all tokens generated / seconds the engine spent generating them
    trained_tokens_per_s: float  # all tokens trained on / wall_s
    trainer_idle: float  # mean over steps
    generator_idle: float
    staleness_mean: float
    replay_share: float
    bubble_ratio: float | None  # rounds' idle engine slot-time share, mean over rounds that generated
    # (None: a streaming mode, no rounds)
    eval_curve: list[tuple[float, float]]  # (seconds, held-out accuracy), raw
    smooth_evals: int = 1  # k: time to target and final accuracy use the trailing mean of k eval points
    final_accuracy_last: float | None = None  # the last evaluation alone (None: same as final_accuracy)
    new_samples: int = 0  # samples trained on for the first time (the data the run used)
    trainer_idle_wall: float = 0.0  # share of the summed step time the trainer was not computing
    cpu_idle: float | None = None  # share of the machine's CPU time idle over the steps (None: not measured)
    data_curve: list[tuple[float, float]] = field(default_factory=list)  # (new samples so far, accuracy), raw
    samples_to_target: float | None = None  # new samples trained on when the target was reached (None: never)
    # shares of the machine's CPU over the steps: the driver process, the Prefect API server (None: not measured)
    driver_cpu: float | None = None
    prefect_server_cpu: float | None = None

    @property
    def new_samples_per_s_to_target(self) -> float | None:
        """New samples trained on per second until the target: ``samples_to_target / time_to_target_s``."""
        if self.samples_to_target is None or not self.time_to_target_s:
            return None
        return self.samples_to_target / self.time_to_target_s


_RESULT = TypeAdapter(ModeResult)


def _mean(steps: list[StepRecord], key: str) -> float:
    values = [r.metrics[key] for r in steps if key in r.metrics]
    return float(statistics.fmean(values)) if values else 0.0


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """First time the curve reaches ``target`` (interpolated between eval points)."""
    for i, (t, acc) in enumerate(curve):
        if acc >= target:
            if i == 0:
                return t
            t0, a0 = curve[i - 1]
            return t0 + (t - t0) * (target - a0) / (acc - a0) if acc > a0 else t
    return None


def smoothed(curve: list[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    """Trailing mean of the last ``k`` points (fewer at the start), at each point's time."""
    if k < 1:
        raise ValueError(f"smooth_evals must be >= 1, got {k}")
    accs = [a for _, a in curve]
    return [(t, statistics.fmean(accs[max(0, i - k + 1): i + 1])) for i, (t, _) in enumerate(curve)]


def data_points(steps: list[StepRecord]) -> list[tuple[float, float]]:
    """(new samples trained on so far, eval accuracy) of the warm start (0) and of the steps that evaluated.

    A step's evaluation is of the weights after it, so its own new samples count.
    """
    points: list[tuple[float, float]] = []
    if steps and "eval_accuracy_baseline" in steps[0].metrics:
        points.append((0.0, steps[0].metrics["eval_accuracy_baseline"]))
    new = 0.0
    for rec in steps:
        new += _new_samples(rec)
        if "eval_accuracy" in rec.metrics:
            points.append((new, rec.metrics["eval_accuracy"]))
    return points


def _reached(curve: list[tuple[float, float]], k: int, target: float | None) -> float | None:
    """Where the trailing mean of ``k`` points of ``curve`` first reaches ``target`` (None: no target, never)."""
    return time_to_target(smoothed(curve, k), target) if target is not None and curve else None


def summarise(mode: str, seed: int, run_dir: str | Path, target: float | None,
              smooth_evals: int = 1) -> ModeResult:
    """A run directory's figures (``target`` None: no time-to-target yet; ``smooth_evals``: see the module)."""
    steps = read_steps(run_dir)
    if not steps:
        raise RuntimeError(f"{run_dir}: no steps were recorded")
    curve = eval_points(steps)
    if not curve:
        raise RuntimeError(f"{run_dir}: no held-out evaluations; set env.eval_prompts > 0")
    wall = steps[-1].elapsed_s
    gen = sum(r.metrics.get("generated_tokens", 0.0) for r in steps)
    engine_s = sum(r.metrics["rollout_seconds"] if "rollout_seconds" in r.metrics else
                   r.metrics.get("generated_tokens", 0.0) / max(r.metrics.get("engine_tokens_per_s", 0.0), 1e-9)
                   for r in steps)
    trained = sum(r.metrics.get("trained_tokens", 0.0) for r in steps)
    # the bubble is a share of the time a round was open: steps whose batch the rollout cache already held
    # opened no round (nothing generated) and do not enter its mean
    ran = [r for r in steps if r.metrics.get("generated_tokens", 0.0) > 0]
    new = sum(_new_samples(r) for r in steps)
    data = data_points(steps)
    return ModeResult(
        mode=mode, seed=seed, run_dir=str(run_dir), steps=len(steps), wall_s=wall, baseline_accuracy=curve[0][1],
        final_accuracy=statistics.fmean(a for _, a in curve[1:][-smooth_evals:] or curve[-1:]),
        final_accuracy_last=curve[-1][1], target_accuracy=target,
        time_to_target_s=_reached(curve, smooth_evals, target),
        generated_tokens_per_s=gen / max(wall, 1e-9), engine_tokens_per_s=gen / max(engine_s, 1e-9),
        trained_tokens_per_s=trained / max(wall, 1e-9),
        trainer_idle=_mean(steps, "trainer_idle_fraction"), generator_idle=_mean(steps, "generator_idle_fraction"),
        staleness_mean=_mean(steps, "staleness_mean"), replay_share=_mean(steps, "replay_share"),
        bubble_ratio=_mean(ran, "rollout_bubble_ratio") if any("rollout_bubble_ratio" in r.metrics for r in steps)
        else None, eval_curve=curve, smooth_evals=smooth_evals, new_samples=int(new),
        trainer_idle_wall=trainer_idle_wall(steps), cpu_idle=machine_cpu_idle(steps), data_curve=data,
        samples_to_target=_reached(data, smooth_evals, target),
        driver_cpu=_wall_weighted(steps, "driver_cpu_fraction"),
        prefect_server_cpu=_wall_weighted(steps, "prefect_server_cpu_fraction"))


def trainer_idle_wall(steps: list[StepRecord]) -> float:
    """Share of the run's step time the trainer was not computing: ``1 - sum(busy_i) / sum(step_s_i)``.

    ``busy_i = (1 - trainer_idle_fraction_i) * step_seconds_i``. The plain
    mean of ``trainer_idle_fraction`` over steps (``trainer_idle``) gives a
    short step as much say as a long one; this one weighs each step by its
    length, so it is the share of the wall clock. Steps without both
    metrics are left out (0.0 when none has them).
    """
    share = _wall_weighted(steps, "trainer_idle_fraction")
    return share if share is not None else 0.0


def machine_cpu_idle(steps: list[StepRecord]) -> float | None:
    """Share of the machine's CPU time idle over the run (``infra.cpu``), steps weighed by length.

    Each step's ``machine_cpu_idle_fraction`` covers the time since the step
    before, as ``step_seconds`` does. None when no step has it (runs from
    before it was logged, or no ``/proc/stat``).
    """
    return _wall_weighted(steps, "machine_cpu_idle_fraction")


def _wall_weighted(steps: list[StepRecord], key: str) -> float | None:
    """``sum(key_i * step_seconds_i) / sum(step_seconds_i)`` over the steps with both; None: none has them."""
    timed = [(r.metrics[key], r.metrics["step_seconds"]) for r in steps
             if key in r.metrics and "step_seconds" in r.metrics]
    total = sum(s for _, s in timed)
    return sum(share * s for share, s in timed) / total if total > 0 else None


def _new_samples(rec: StepRecord) -> float:
    """Samples a step trained on for the first time: fresh and stale ones (streaming), or all (rounds)."""
    if "fresh_samples" in rec.metrics:
        return rec.metrics["fresh_samples"] + rec.metrics.get("stale_samples", 0.0)
    return rec.metrics.get("samples", 0.0)


def equal_data(total_steps: int, groups_per_step: int, fresh_groups_per_step: int) -> list[str]:
    """``--set`` overrides that end a run after ``total_steps`` batches' worth of new groups.

    Every mode then trains on the same data: sync, one_step_off and async
    train on a full batch of new groups per step and stop after
    ``total_steps``; reflow tops its batches up with replayed groups, so it
    gets as many steps as its fewest new groups per batch could need, and
    stops when the budget is spent.
    """
    budget = total_steps * groups_per_step
    steps = -(-budget // max(1, fresh_groups_per_step))
    return [f"run.max_new_groups={budget}", f"run.total_steps={steps}"]


def default_target(sync: ModeResult, share: float = 0.75) -> float:
    """Warm-start accuracy plus ``share`` of sync's gain (at least +0.01)."""
    gain = max(sync.final_accuracy - sync.baseline_accuracy, 0.01)
    return sync.baseline_accuracy + share * gain


# Shares of sync's gain at which ``by_share`` times every mode (the default target is 0.75).
TARGET_SHARES = (0.5, 0.75, 0.9)


def by_share(results: list[ModeResult], shares: tuple[float, ...] = TARGET_SHARES) -> dict[str, dict]:
    """Time to ``default_target(sync, share)`` per share, mode and seed (None: not reached).

    One target says little about how a speedup depends on where the target
    sits: a low one is reached in a few steps, where the first step (a full
    batch of new groups in every mode) weighs most. Seeds without a sync run
    are left out. ``{share: {mode: {seed: seconds or None}}}``, shares as
    strings (JSON keys).
    """
    out: dict[str, dict] = {}
    for share in shares:
        rows: dict[str, dict[int, float | None]] = {}
        for r in results:
            sync = next((s for s in results if s.seed == r.seed and s.mode == "sync"), None)
            if sync is not None:
                rows.setdefault(r.mode, {})[r.seed] = time_to_target(smoothed(r.eval_curve, r.smooth_evals),
                                                                     default_target(sync, share))
        out[f"{share:g}"] = rows
    return out


def share_table(shares: dict[str, dict]) -> str:
    """``by_share`` as text: seconds per seed, and sync's time over the mode's in brackets."""
    lines = ["time to warm-start + SHARE of sync's gain, s per seed (x: sync's time / the mode's)"]
    for share, rows in shares.items():
        sync = rows.get("sync", {})
        for i, (mode, times) in enumerate(rows.items()):
            cells = []
            for seed, t in times.items():
                ref = sync.get(seed)
                ratio = f" ({ref / t:.2f}x)" if t and ref and mode != "sync" else ""
                cells.append(f"s{seed} {'never' if t is None else f'{t:.1f}'}{ratio}")
            lines.append(f"{share if i == 0 else '':<6}{mode:<17}" + "   ".join(cells))
    return "\n".join(lines)


def with_target(result: ModeResult, target: float) -> ModeResult:
    data = asdict(result)
    data.update(target_accuracy=target, time_to_target_s=_reached(result.eval_curve, result.smooth_evals, target),
                samples_to_target=_reached(result.data_curve, result.smooth_evals, target))
    data["eval_curve"] = [tuple(p) for p in data["eval_curve"]]
    data["data_curve"] = [tuple(p) for p in data["data_curve"]]
    return ModeResult(**data)


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def aggregate(results: list[ModeResult]) -> dict[str, dict]:
    """Per mode: mean/min/max over seeds of each figure, and speedups of time-to-target."""
    modes = list(dict.fromkeys(r.mode for r in results))
    out: dict[str, dict] = {}
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        reached = [r.time_to_target_s for r in rs if r.time_to_target_s is not None]
        entry = {key: _spread([getattr(r, key) for r in rs]) for key in
                 ("final_accuracy", "wall_s", "generated_tokens_per_s", "engine_tokens_per_s",
                  "trained_tokens_per_s", "trainer_idle", "trainer_idle_wall",
                  "generator_idle", "staleness_mean", "replay_share", "steps", "new_samples")}
        bubbles = [r.bubble_ratio for r in rs if r.bubble_ratio is not None]
        entry["bubble_ratio"] = _spread(bubbles) if bubbles else None
        for key in ("cpu_idle", "driver_cpu", "prefect_server_cpu"):
            values = [getattr(r, key) for r in rs if getattr(r, key) is not None]
            entry[key] = _spread(values) if values else None
        entry["time_to_target_s"] = _spread(reached) if len(reached) == len(rs) else None
        data = [r.samples_to_target for r in rs if r.samples_to_target is not None]
        entry["samples_to_target"] = _spread(data) if len(data) == len(rs) else None
        rates = [r.new_samples_per_s_to_target for r in rs if r.new_samples_per_s_to_target is not None]
        entry["new_samples_per_s_to_target"] = _spread(rates) if len(rates) == len(rs) else None
        entry["seeds_reaching_target"] = len(reached)
        entry["seeds"] = len(rs)
        out[mode] = entry
    ttt = {m: e["time_to_target_s"]["mean"] for m, e in out.items() if e["time_to_target_s"]}
    for mode, entry in out.items():
        mine = ttt.get(mode)
        entry["speedup_vs_sync"] = ttt["sync"] / mine if mine and "sync" in ttt else None
        others = [t for m, t in ttt.items() if m != mode and m in ("sync", "one_step_off", "async")]
        entry["speedup_vs_best_baseline"] = min(others) / mine if mine and others and mode == "reflow" else None
        if "sync" in out:
            for key in ("generated_tokens_per_s", "engine_tokens_per_s"):
                entry[f"{key}_vs_sync"] = entry[key]["mean"] / max(out["sync"][key]["mean"], 1e-9)
    return out


# The speed targets for reflow: sooner than the fastest baseline by 1.3x, than sync by 2x.
# Bench rows that are a mode plus a rollout scheduling (SortedRL rows run in sync mode).
ROWS: dict[str, tuple[str, str]] = {
    "sync": ("sync", "plain"), "one_step_off": ("one_step_off", "plain"), "async": ("async", "plain"),
    "reflow": ("reflow", "plain"), "sorted_on_policy": ("sync", "sorted_on_policy"),
    "sorted_partial": ("sync", "sorted_partial"),
}
SPEEDUP_TARGETS = {"vs_best_baseline": 1.3, "vs_sync": 2.0}
BASELINES = ("sync", "one_step_off", "async")


def invocation(result: ModeResult) -> str:
    """The bench output directory a run belongs to (``OUT/runs/<mode>-s<seed>/<run>``): one invocation."""
    parts = Path(result.run_dir).parts
    return parts[-4] if len(parts) >= 4 and parts[-3] == "runs" else str(Path(result.run_dir).parent)


def seed_rows(results: list[ModeResult], mode: str) -> list[tuple[str, int, dict[str, ModeResult]]]:
    """``(invocation, seed, {mode name: result})`` for each seed of each invocation that ran ``mode``."""
    keys = sorted({(invocation(r), r.seed) for r in results if r.mode == mode})
    return [(inv, seed, {r.mode: r for r in results if r.seed == seed and invocation(r) == inv}) for inv, seed in keys]


def seed_speedups(results: list[ModeResult], mode: str = "reflow") -> dict:
    """``mode``'s speedups seed by seed, and how they spread over the seeds.

    ``aggregate``'s speedups are ratios of means over seeds, in which the
    slowest seed weighs most. Here each seed (of each bench invocation: the
    rows of one seed run one after another on one machine, so their ratios
    share its speed of the moment) gives its own ratios: ``vs_sync`` is
    sync's time to target over the mode's, ``vs_best_baseline`` the fastest
    baseline's (sync, one_step_off, async; those that never reached the
    target left out) over the mode's. A mode that never reached it scores
    0.0 against a baseline that did; no ratio (None) where neither did. A
    seed where the mode reached the target and no baseline did meets
    ``SPEEDUP_TARGETS`` (``best`` None). Per ratio over the seeds: ``median``,
    ``min``, ``max`` of the defined ratios, and ``met``, the seeds at or
    over the target, out of ``seeds``.
    """
    seeds: list[dict] = []
    for invocation, seed, rows in seed_rows(results, mode):
        mine = rows[mode].time_to_target_s
        reached = {m: rows[m].time_to_target_s for m in BASELINES
                   if m in rows and m != mode and rows[m].time_to_target_s is not None}
        best = min(reached, key=reached.get) if reached else None
        entry: dict[str, Any] = {"invocation": invocation, "seed": seed, "time_to_target_s": mine, "best": best,
                                 "final_accuracy": rows[mode].final_accuracy,
                                 "sync_final_accuracy": rows["sync"].final_accuracy if "sync" in rows else None}
        for key, ref in (("vs_sync", reached.get("sync")), ("vs_best_baseline", reached.get(best) if best else None)):
            if ref is None:  # the baseline(s) never reached the target, or did not run
                ran = "sync" in rows if key == "vs_sync" else any(m in rows for m in BASELINES if m != mode)
                entry[key] = None
                entry[f"{key}_met"] = mine is not None and ran
            else:
                # at t=0 (the warm start already at the target): as soon as a baseline also there, else sooner
                entry[key] = 0.0 if mine is None else ref / mine if mine > 0 else 1.0 if ref == 0 else float("inf")
                entry[f"{key}_met"] = entry[key] >= SPEEDUP_TARGETS[key]
        seeds.append(entry)
    spread: dict[str, Any] = {"seeds": len(seeds)}
    for key, goal in SPEEDUP_TARGETS.items():
        values = [e[key] for e in seeds if e[key] is not None]
        spread[key] = {"target": goal, "met": sum(e[f"{key}_met"] for e in seeds),
                       **({"median": statistics.median(values), "min": min(values), "max": max(values)}
                          if values else {})}
    return {"mode": mode, "per_seed": seeds, "spread": spread}


def seed_table(speedups: dict) -> str:
    """``seed_speedups`` as text: one line per seed, then the spread."""
    mode = speedups["mode"]
    lines = [f"{mode} seed by seed (x: the other's time to target / {mode}'s)"]
    for e in speedups["per_seed"]:
        mine = "never" if e["time_to_target_s"] is None else f"{e['time_to_target_s']:.1f} s"
        best = "no baseline reached" if e["best"] is None else (
            f"{e['vs_best_baseline']:.2f}x the best baseline ({e['best']})")
        sync = "-" if e["vs_sync"] is None else f"{e['vs_sync']:.2f}x"
        final = "" if e["sync_final_accuracy"] is None else (
            f"; final {e['final_accuracy']:.3f} (sync {e['sync_final_accuracy']:.3f})")
        lines.append(f"  {e['invocation']}/s{e['seed']}: {mine}, {best}, {sync} sync{final}")
    spread = speedups["spread"]
    for key, label in (("vs_best_baseline", "the best baseline"), ("vs_sync", "sync")):
        s = spread[key]
        span = f"median {s['median']:.2f}x ({s['min']:.2f}x to {s['max']:.2f}x), " if "median" in s else ""
        lines.append(f"  against {label}: {span}{s['met']} of {spread['seeds']} seeds at {s['target']}x or more")
    return "\n".join(lines)


def load_results(path: Path) -> list[ModeResult]:
    """The runs of a ``bench.json`` (``path``: the file or its directory), as written by ``write_json``."""
    path = path / "bench.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a bench.json written by reflow bench ({exc})") from exc
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        raise ValueError(f"{path}: not a bench.json written by reflow bench (no 'runs' list of run objects)")
    out = []
    for i, run in enumerate(runs):
        try:
            result = _RESULT.validate_python(run)  # each field's type, as ``write_json`` writes it
        except ValidationError as exc:
            raise ValueError(format_errors(exc, f"{path}: runs[{i}] is not a run reflow bench wrote")) from None
        if result.mode not in ROWS:
            raise ValueError(f"{path}: runs[{i}].mode {result.mode!r} is not a bench mode ({', '.join(ROWS)})")
        out.append(result)
    return out


def load_meta(path: Path) -> dict[str, Any]:
    """The ``meta`` of a ``bench.json`` (``path``: the file or its directory): the config, its text and the
    overrides its runs read. ValueError naming the file if it has none, or they are not what ``write_json`` keeps."""
    path = path / "bench.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a bench.json written by reflow bench ({exc})") from exc
    meta = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: no 'meta' object (the config and overrides its runs read); not a bench.json "
                         "written by reflow bench")
    overrides = meta.get("overrides", [])
    if not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)
            and all(isinstance(meta.get(k), str | None) for k in ("config", "config_text"))):
        raise ValueError(f"{path}: meta.overrides must be a list of KEY=VALUE strings and meta.config, "
                         "meta.config_text strings")
    return meta


def row_overrides(config: str | None, overrides: list[str], mode: str, seed: int, equal_steps: bool) -> list[str]:
    """The ``--set`` items of row ``mode`` and ``seed``'s ``reflow run`` (``flows.bench.bench_mode``): ``overrides``,
    the row's mode and scheduling, the equal-data run length unless ``equal_steps``, the seed, deferred
    evaluation, the run's name. ConfigError if the config so far is not valid."""
    kind, scheduling = ROWS[mode]
    rows = [f"mode.kind={json.dumps(kind)}", f"rollout.scheduling={json.dumps(scheduling)}"]
    if not equal_steps:
        cfg = load_config(config, [*overrides, *rows])
        rows += equal_data(cfg.run.total_steps, cfg.rollout.prompts_per_step, cfg.fresh_groups_per_step())
    return [*overrides, *rows, f"run.seed={seed}", "eval.deferred=true",
            f"run.name={json.dumps(f'bench-{mode}-s{seed}')}"]


# The fields ``row_overrides`` sets for every row, after the user's overrides: a ``--set`` of one would be lost.
ROW_FIELDS = {"mode.kind": "choose the rows with --modes", "rollout.scheduling": "choose the rows with --modes",
              "run.seed": "give the seeds with --seeds", "run.name": "each row's run is named bench-MODE-sSEED",
              "eval.deferred": "the bench always defers evaluation (off the training clock)"}


def check_rows(config: str | None, overrides: list[str], modes: list[str], seeds: list[int], out: Path,
               equal_steps: bool) -> None:
    """Before any row runs: ValueError naming an override the rows would replace (``ROW_FIELDS``), or the first
    mode and seed whose config is not valid (a mode's own checks: SortedRL rounds with tool calls, say) or whose
    run directory under ``out`` already holds a run."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in ROW_FIELDS:
            raise ValueError(f"--set {key}: the bench sets it for each row; {ROW_FIELDS[key]}")
    for seed in seeds:
        for mode in modes:
            try:
                load_config(config, row_overrides(config, overrides, mode, seed, equal_steps))
            except ValueError as exc:
                raise ValueError(f"mode {mode}, seed {seed}: {exc}") from None
            runs = out / "runs" / f"{mode}-s{seed}"
            if runs.exists() and (not runs.is_dir() or any(runs.iterdir())):
                raise ValueError(f"--output: {str(runs)!r} already holds mode {mode}, seed {seed}; choose a new "
                                 "--output")


def repeat_key(path: Path) -> str | None:
    """What makes two bench outputs repeats of one variant: the same config (the TOML its runs read, comments
    aside; the file's path for outputs written before ``config_text``), overrides, modes, seeds and targets (sync
    repeats its runs exactly with the default loss, so repeats share their targets; where it did not, the outputs
    are not repeats). None: no ``meta``."""
    path = path / "bench.json" if path.is_dir() else path
    meta = json.loads(path.read_text()).get("meta")
    if not isinstance(meta, dict):
        return None
    key = {k: meta.get(k) for k in ("overrides", "modes", "seeds", "targets")}
    if "config_text" in meta:
        try:
            key["config"] = tomllib.loads(meta["config_text"])
        except (tomllib.TOMLDecodeError, TypeError):
            key["config"] = meta["config_text"]
    else:
        key["config"] = meta.get("config")
    return json.dumps(key, sort_keys=True, default=str)


def table(summary: dict[str, dict]) -> str:
    """The per-mode table printed at the end of ``reflow bench``."""
    head = (f"{'mode':<17}{'to target s':>12}{'vs sync':>8}{'final acc':>10}{'gen tok/s':>10}{'engine tok/s':>13}"
            f"{'train tok/s':>12}"
            f"{'trainer idle':>13}{'(wall)':>7}{'gen idle':>9}{'cpu idle':>9}{'ctl cpu':>8}"
            f"{'stale':>6}{'replay':>7}{'bubble':>7}"
            f"{'new smp to tgt':>15}{'new smp/s to tgt':>17}")
    rows = [head, "-" * len(head)]
    for mode, e in summary.items():
        t = e["time_to_target_s"]
        ttt = f"{t['mean']:.0f}" if t else f"{e['seeds_reaching_target']}/{e['seeds']} hit"
        vs = f"{e['speedup_vs_sync']:.2f}x" if e["speedup_vs_sync"] else "-"
        rows.append(f"{mode:<17}{ttt:>12}{vs:>8}{e['final_accuracy']['mean']:>10.3f}"
                    f"{e['generated_tokens_per_s']['mean']:>10.0f}{e['engine_tokens_per_s']['mean']:>13.0f}"
                    f"{e['trained_tokens_per_s']['mean']:>12.0f}"
                    f"{e['trainer_idle']['mean']:>12.0%} {e['trainer_idle_wall']['mean']:>6.0%}"
                    f" {e['generator_idle']['mean']:>8.0%}"
                    + (f" {e['cpu_idle']['mean']:>8.0%}" if e.get("cpu_idle") else f"{'-':>9}")
                    + (f" {e['driver_cpu']['mean'] + e['prefect_server_cpu']['mean']:>7.1%}"
                       if e.get("driver_cpu") and e.get("prefect_server_cpu") else f"{'-':>8}")
                    + f"{e['staleness_mean']['mean']:>6.2f}{e['replay_share']['mean']:>7.0%}"
                    + (f"{e['bubble_ratio']['mean']:>7.0%}" if e["bubble_ratio"] else f"{'-':>7}")
                    + (f"{e['samples_to_target']['mean']:>15.0f}" if e.get("samples_to_target") else f"{'-':>15}")
                    + (f"{e['new_samples_per_s_to_target']['mean']:>17.1f}" if e.get("new_samples_per_s_to_target")
                       else f"{'-':>17}"))
    return "\n".join(rows)


def plot(results: list[ModeResult], path: Path) -> Path:
    """Held-out accuracy against training wall-clock (left) and against new samples trained on (right).

    One colour per mode, one line per seed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_data) = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    colours = dict(zip(dict.fromkeys(r.mode for r in results), plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    labelled: set[str] = set()
    for r in results:
        label = None if r.mode in labelled else r.mode
        _curve(by_time, r.eval_curve, r.smooth_evals, colours[r.mode], label)
        _curve(by_data, r.data_curve, r.smooth_evals, colours[r.mode], None)
        labelled.add(r.mode)
    targets = {r.target_accuracy for r in results if r.target_accuracy is not None}
    k = max((r.smooth_evals for r in results), default=1)
    for ax, xlabel in ((by_time, "training wall-clock seconds"), (by_data, "new samples trained on")):
        for t in targets:
            ax.axhline(t, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel("held-out accuracy")
    by_time.legend(loc="lower right")
    by_time.set_title("accuracy vs time" + (f" (lines: trailing mean of {k} evaluations)" if k > 1 else ""))
    by_data.set_title("accuracy vs new data (replayed samples count once)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve(ax: Any, curve: list[tuple[float, float]], k: int, colour: str, label: str | None) -> None:
    """Raw evaluations as dots and their trailing mean (what the figures use) as a line; k == 1: one line."""
    if k > 1:
        ax.plot([p[0] for p in curve], [p[1] for p in curve], "o", color=colour, ms=2.5, alpha=0.4)
        line = smoothed(curve, k)
        ax.plot([p[0] for p in line], [p[1] for p in line], "-", color=colour, alpha=0.9, label=label)
    else:
        ax.plot([p[0] for p in curve], [p[1] for p in curve], "o-", color=colour, ms=3, alpha=0.85, label=label)


def write_json(path: Path, results: list[ModeResult], summary: dict, meta: dict,
               shares: dict | None = None, speedups: dict | None = None, limits: dict | None = None) -> Path:
    """``bench.json``: meta, per-mode summary, every run, ``by_share`` (``time_to_share_of_sync_gain``),
    ``seed_speedups`` (``reflow_by_seed``) and ``bench_limits.speed_limits`` (``reflow_limits``)."""
    tmp = path.with_suffix(".json.tmp")
    runs = [{**asdict(r), "new_samples_per_s_to_target": r.new_samples_per_s_to_target} for r in results]
    data = {"meta": meta, "summary": summary, "runs": runs}
    if shares is not None:
        data["time_to_share_of_sync_gain"] = shares
    if speedups is not None:
        data["reflow_by_seed"] = speedups
    if limits is not None:
        data["reflow_limits"] = limits
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path
