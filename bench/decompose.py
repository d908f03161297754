"""Where a mode's speedup comes from, and how far the machine lets it go.

``bench.mode_bench`` splits time to target into ``samples_to_target /
new_samples_per_s_to_target``. Here the rate is split once more, by the
machine's CPU (``cpu_idle``: the share of all cores idle over the run). Of
mode ``m`` against a reference ``r`` (same seed, same invocation)::

    speedup = T_r / T_m = data * utilisation * efficiency
    data        = S_r / S_m                       new samples to target (replay, staleness, batch shape)
    utilisation = (1 - i_m) / (1 - i_r)           busy share of the machine (the overlap)
    efficiency  = (R_m / R_r) / utilisation       new samples per busy machine-second (the inverse of what a
                                                  new sample costs: generation, training, replays, control)

with ``S`` samples to target, ``R = S / T`` new samples per second to
target and ``i`` the run's CPU idle share. ``efficiency`` is the residual,
so the product is the measured speedup exactly; ``i`` is the whole run's, so
``utilisation`` is the part the overlap explains as far as the run's mean
load tells it.

On a machine where every role shares the same cores, overlapping loops can
only put idle CPU to work: ``utilisation <= 1 / (1 - i_r)`` (``ceiling``),
reached when the mode leaves no core idle. Any speedup beyond it must come
from ``data * efficiency``: fewer new samples, or cheaper ones (the
overlap can help there too: an engine kept at high concurrency decodes more
tokens per CPU-second than a round's tail). ``needed`` is the ``data *
efficiency`` a target speedup calls for at the ceiling: ``target * (1 -
i_r)``. On separate devices per role (GPUs) the ceiling is the reference's
idle device time instead, which this machine cannot measure.
"""

from __future__ import annotations

import statistics
from typing import Any

from reflow.bench.mode_bench import BASELINES, SPEEDUP_TARGETS, ModeResult, seed_rows


def decompose(mine: ModeResult, ref: ModeResult) -> dict[str, float] | None:
    """``speedup``, ``data``, ``utilisation``, ``efficiency`` of ``mine`` against ``ref``; None without the figures.

    Both must have reached the target after t=0 and have ``cpu_idle`` measured (below 1).
    """
    figures = (mine.time_to_target_s, ref.time_to_target_s, mine.samples_to_target, ref.samples_to_target)
    if not all(figures) or mine.cpu_idle is None or ref.cpu_idle is None or max(mine.cpu_idle, ref.cpu_idle) >= 1:
        return None
    speedup = ref.time_to_target_s / mine.time_to_target_s
    data = ref.samples_to_target / mine.samples_to_target
    utilisation = (1 - mine.cpu_idle) / (1 - ref.cpu_idle)
    return {"speedup": speedup, "data": data, "utilisation": utilisation,
            "efficiency": speedup / (data * utilisation), "ceiling": 1 / (1 - ref.cpu_idle)}


def speed_limits(results: list[ModeResult], mode: str = "reflow") -> dict[str, Any]:
    """Per seed of each invocation: ``mode`` against sync and against its fastest baseline, decomposed.

    Each entry: ``against`` (the baseline's name), the ``decompose`` figures,
    the issue's ``target`` for that ratio and ``needed`` (``data * efficiency`` at
    the ceiling to meet it). Baselines that did not reach the target, or runs
    without ``cpu_idle``, give no entry.
    """
    per_seed = []
    for invocation, seed, rows in seed_rows(results, mode):
        reached = {m: rows[m] for m in BASELINES if m in rows and m != mode and rows[m].time_to_target_s is not None}
        best = min(reached, key=lambda m: reached[m].time_to_target_s) if reached else None
        entry: dict[str, Any] = {"invocation": invocation, "seed": seed}
        for key, against in (("vs_sync", "sync" if "sync" in reached else None), ("vs_best_baseline", best)):
            parts = decompose(rows[mode], reached[against]) if against else None
            if parts is not None:
                goal = SPEEDUP_TARGETS[key]
                entry[key] = {"against": against, **parts, "target": goal,
                              "needed": goal * (1 - reached[against].cpu_idle)}
        per_seed.append(entry)
    return {"mode": mode, "per_seed": per_seed}


def limits_table(limits: dict[str, Any]) -> str:
    """``speed_limits`` as text: one line per seed and reference."""
    mode = limits["mode"]
    lines = [f"{mode}'s speedup = data x utilisation x efficiency (utilisation at most its ceiling; "
             f"needed: data x efficiency to meet the target at the ceiling)"]
    for e in limits["per_seed"]:
        for key in ("vs_sync", "vs_best_baseline"):
            p = e.get(key)
            if p is None:
                continue
            label = p["against"] + (" (best baseline)" if key == "vs_best_baseline" else "")
            lines.append(f"  {e['invocation']}/s{e['seed']} vs {label}: {p['speedup']:.2f}x = "
                         f"data {p['data']:.2f} x utilisation {p['utilisation']:.2f} (ceiling {p['ceiling']:.2f})"
                         f" x efficiency {p['efficiency']:.2f}; {p['target']}x needs data x efficiency >= "
                         f"{p['needed']:.2f}, has {p['data'] * p['efficiency']:.2f}")
    if len(lines) == 1:
        lines.append("  no seed with the figures (a baseline reaching the target and the CPU idle share measured)")
    return "\n".join(lines)


# The bar for the data factor against sync (median over seeds), and for final accuracy.
DATA_TARGETS = {"async": 1.0, "reflow": 1.2}
ACCURACY_TOLERANCE = 0.02


def data_factors(results: list[ModeResult], repeats: list[list[str]] | None = None) -> dict[str, Any]:
    """Every mode's data factor against sync, seed by seed of each invocation, and its median per invocation.

    ``data = S_sync / S_mode`` (new samples to target; above 1: the mode
    needs fewer new samples than sync). Per row: ``samples_to_target``,
    ``data`` (None where either never reached the target), ``time_to_target_s``,
    ``final_accuracy`` and its difference from sync's. Per invocation and mode
    (an invocation is one bench output: one variant of the config): the
    medians of ``data`` and of the accuracy difference over its seeds, and
    whether they meet ``DATA_TARGETS`` and ``ACCURACY_TOLERANCE``.

    ``repeats``: groups of invocations that ran the same variant (the same
    config, overrides, seeds and targets; ``mode_bench.repeat_key``). Per
    group of two or more and mode, ``pooled`` holds each seed's data factor
    over the repeats, ``mean(S_sync) / mean(S_mode)`` (None where a repeat
    never reached the target; 0 in the median), the mean accuracy
    difference, and the medians over the seeds against the bar. One
    invocation's median moves by about 0.18 from run to run here
    (docs/benchmark.md), more than the bars' margins.
    """
    rows: list[dict[str, Any]] = []
    modes = [m for m in ("sync", *BASELINES[1:], "reflow") if any(r.mode == m for r in results)]
    modes += sorted({r.mode for r in results} - set(modes))
    for invocation, seed, by_mode in seed_rows(results, "sync"):
        sync = by_mode["sync"]
        for mode in modes:
            if mode not in by_mode:
                continue
            r = by_mode[mode]
            data = (sync.samples_to_target / r.samples_to_target
                    if sync.samples_to_target and r.samples_to_target else None)
            rows.append({"invocation": invocation, "seed": seed, "mode": mode,
                         "samples_to_target": r.samples_to_target, "data": data,
                         "time_to_target_s": r.time_to_target_s, "final_accuracy": r.final_accuracy,
                         "accuracy_vs_sync": r.final_accuracy - sync.final_accuracy,
                         "staleness_mean": r.staleness_mean, "replay_share": r.replay_share})
    medians: list[dict[str, Any]] = []
    for invocation in dict.fromkeys(r["invocation"] for r in rows):
        for mode in modes:
            mine = [r for r in rows if r["invocation"] == invocation and r["mode"] == mode]
            if not mine or mode == "sync":
                continue
            data = [r["data"] if r["data"] is not None else 0.0 for r in mine]  # never reached: no data at all
            accuracy = statistics.median(r["accuracy_vs_sync"] for r in mine)
            goal = DATA_TARGETS.get(mode)
            medians.append({"invocation": invocation, "mode": mode, "seeds": len(mine),
                            "data_median": statistics.median(data), "accuracy_vs_sync_median": accuracy,
                            "data_target": goal,
                            "met": None if goal is None else (statistics.median(data) >= goal
                                                              and accuracy >= -ACCURACY_TOLERANCE)})
    pooled: list[dict[str, Any]] = []
    for group in repeats or []:
        if len(group) < 2:
            continue
        for mode in modes:
            if mode == "sync":
                continue
            seeds = []
            for seed in sorted({r["seed"] for r in rows if r["invocation"] in group and r["mode"] == mode}):
                mine = [r for r in rows if r["invocation"] in group and r["seed"] == seed and r["mode"] == mode]
                sync = [r for r in rows if r["invocation"] in group and r["seed"] == seed and r["mode"] == "sync"]
                if len(mine) < len(group):
                    continue  # a repeat without this seed and mode: not pooled
                reached = all(r["samples_to_target"] for r in mine + sync)
                data = (statistics.mean(r["samples_to_target"] for r in sync)
                        / statistics.mean(r["samples_to_target"] for r in mine)) if reached else None
                seeds.append({"seed": seed, "data": data,
                              "accuracy_vs_sync": statistics.mean(r["accuracy_vs_sync"] for r in mine)})
            if not seeds:
                continue
            data_median = statistics.median(s["data"] if s["data"] is not None else 0.0 for s in seeds)
            accuracy = statistics.median(s["accuracy_vs_sync"] for s in seeds)
            goal = DATA_TARGETS.get(mode)
            pooled.append({"invocations": list(group), "mode": mode, "per_seed": seeds, "data_median": data_median,
                           "accuracy_vs_sync_median": accuracy, "data_target": goal,
                           "met": None if goal is None else (data_median >= goal
                                                             and accuracy >= -ACCURACY_TOLERANCE)})
    return {"per_seed": rows, "medians": medians, "pooled": pooled}


def data_table(factors: dict[str, Any]) -> str:
    """``data_factors`` as text: one line per seed and mode, then the medians."""
    lines = ["data factor against sync (sync's new samples to target / the mode's), seed by seed",
             f"  {'bench/seed':<24}{'mode':<14}{'new smp to tgt':>15}{'data':>7}{'to target s':>12}"
             f"{'final acc':>10}{'vs sync':>8}{'stale':>6}{'replay':>7}"]
    for r in factors["per_seed"]:
        samples = "never" if r["samples_to_target"] is None else f"{r['samples_to_target']:.0f}"
        data = "-" if r["data"] is None else f"{r['data']:.2f}"
        ttt = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"  {r['invocation'] + '/s' + str(r['seed']):<24}{r['mode']:<14}{samples:>15}{data:>7}"
                     f"{ttt:>12}{r['final_accuracy']:>10.3f}{r['accuracy_vs_sync']:>+8.3f}"
                     f"{r['staleness_mean']:>6.2f}{r['replay_share']:>7.0%}")
    for m in factors["medians"]:
        goal = "" if m["data_target"] is None else (
            f" (target {m['data_target']:.1f} with accuracy within {ACCURACY_TOLERANCE}: "
            f"{'met' if m['met'] else 'not met'})")
        lines.append(f"  {m['invocation']} {m['mode']}: median data {m['data_median']:.2f} over {m['seeds']} "
                     f"seed(s), final accuracy {m['accuracy_vs_sync_median']:+.3f} against sync{goal}")
    if len(lines) == 2:
        lines.append("  no seed with a sync row")
    for p in factors.get("pooled", []):
        per_seed = " / ".join("never" if s["data"] is None else f"{s['data']:.2f}" for s in p["per_seed"])
        goal = "" if p["data_target"] is None else (
            f" (target {p['data_target']:.1f} with accuracy within {ACCURACY_TOLERANCE}: "
            f"{'met' if p['met'] else 'not met'})")
        lines.append(f"  pooled over {len(p['invocations'])} repeats ({', '.join(p['invocations'])}) {p['mode']}: "
                     f"data per seed {per_seed}, median {p['data_median']:.2f}, final accuracy "
                     f"{p['accuracy_vs_sync_median']:+.3f} against sync{goal}")
    return "\n".join(lines)
