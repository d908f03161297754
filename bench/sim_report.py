"""The simulator's figures: per-run summaries, the table, ``sim.json``, the PNG, and the check against a bench.

A simulated run is summarised with the names ``reflow bench`` uses
(``bench.mode_bench``), each figure computed from the simulated steps the
way the bench computes it from a real run's ``steps.jsonl``: idle
fractions are means over steps, tokens per second are totals over the
training clock, the bubble is the mean over rounds.

Time to target: a simulator cannot learn. ``est_time_to_target_s`` is the
new samples a real run needed to reach its target (``samples_to_target``
in a ``bench.json``, mean over its seeds, same mode) divided by the
simulated rate of new samples; it is labelled as such wherever it shows.

Validation (``validate``): for each mode and seed in both a bench and the
simulation of the same config, the relative error of the step time,
trainer idle, generator idle, bubble (rounds) and generated tokens per
second (shares of the step also in points: a relative error of a share
near zero says little). ``TOLERANCE`` is the issue's 15%.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reflow.bench import mode_bench
from reflow.bench.simulate import SimRun

TOLERANCE = 0.15
FIGURES = ("step_s", "trainer_idle", "generator_idle", "bubble_ratio", "generated_tokens_per_s")
SHARES = ("trainer_idle", "generator_idle", "bubble_ratio")  # shares of the step: also compared in points


@dataclass(frozen=True)
class SimResult:
    """One simulated mode and seed, summarised like ``mode_bench.ModeResult``."""

    mode: str
    seed: int
    engines: int
    trainer_ranks: int
    steps: int
    wall_s: float
    step_s: float  # wall_s / steps
    samples_per_s: float  # samples trained on (replays included) per second
    new_samples_per_s: float  # samples trained on for the first time per second
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    trainer_idle: float  # mean over steps
    generator_idle: float  # mean over steps, the pool's engine-seconds
    staleness_mean: float
    replay_share: float
    bubble_ratio: float | None  # rounds: mean over rounds; None: streaming
    new_samples: int
    est_time_to_target_s: float | None = None  # a bench's samples to target / new_samples_per_s (module doc)
    role_switches: int = 0  # the elastic pool's (resources.flex_workers)
    helper_steps: int = 0  # steps a flex worker computed a share of
    # streaming: CPU seconds per step of the real control-plane code in the simulation (SimRun.cpu_s); None: rounds
    control_cpu_s_per_step: float | None = None


def summarise(run: SimRun) -> SimResult:
    steps = run.steps
    if not steps:
        raise ValueError(f"{run.mode} seed {run.seed}: the simulation recorded no step")
    wall = steps[-1].elapsed_s
    bubbles = [s.bubble_ratio for s in steps if s.bubble_ratio is not None]
    new = sum(s.new_samples for s in steps)
    return SimResult(
        mode=run.mode, seed=run.seed, engines=run.engines, trainer_ranks=run.trainer_ranks, steps=len(steps),
        wall_s=wall, step_s=wall / len(steps), samples_per_s=sum(s.samples for s in steps) / wall,
        new_samples_per_s=new / wall, generated_tokens_per_s=sum(s.generated_tokens for s in steps) / wall,
        trained_tokens_per_s=sum(s.trained_tokens for s in steps) / wall,
        trainer_idle=statistics.fmean(s.trainer_idle() for s in steps),
        generator_idle=statistics.fmean(s.generator_idle(run.engines) for s in steps),
        staleness_mean=statistics.fmean(s.staleness_mean for s in steps),
        replay_share=statistics.fmean(s.replay_share for s in steps),
        bubble_ratio=statistics.fmean(bubbles) if bubbles else None, new_samples=new,
        role_switches=run.switches, helper_steps=run.helper_steps,
        control_cpu_s_per_step=(run.cpu_s - run.model_cpu_s) / len(steps) if run.cpu_s else None)


def with_targets(results: list[SimResult], bench: list[mode_bench.ModeResult]) -> list[SimResult]:
    """Each result with ``est_time_to_target_s`` from the bench runs of its mode (None: none reached it)."""
    out = []
    for r in results:
        needed = [b.samples_to_target for b in bench if b.mode == r.mode and b.samples_to_target is not None]
        est = statistics.fmean(needed) / r.new_samples_per_s if needed and r.new_samples_per_s > 0 else None
        out.append(SimResult(**{**asdict(r), "est_time_to_target_s": est}))
    return out


def aggregate(results: list[SimResult]) -> dict[str, dict[str, Any]]:
    """Per mode: the mean over seeds of every figure (None where a figure has no value)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == mode]
        entry: dict[str, Any] = {"seeds": len(rs)}
        for key, value in asdict(rs[0]).items():
            if key in ("mode", "seed") or not isinstance(value, (int, float)) and value is not None:
                continue
            values = [getattr(r, key) for r in rs if getattr(r, key) is not None]
            entry[key] = statistics.fmean(values) if values else None
        out[mode] = entry
    sync = out.get("sync", {}).get("new_samples_per_s")
    for entry in out.values():
        entry["new_samples_per_s_vs_sync"] = entry["new_samples_per_s"] / sync if sync else None
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = (f"{'mode':<14}{'engines':>8}{'ranks':>6}{'step s':>8}{'samples/s':>10}{'new smp/s':>10}{'vs sync':>8}"
            f"{'gen tok/s':>11}{'trainer idle':>13}{'gen idle':>9}{'bubble':>7}{'stale':>6}{'replay':>7}"
            f"{'est. to target s*':>18}")
    rows = [head, "-" * len(head)]
    for mode, e in summary.items():
        vs = f"{e['new_samples_per_s_vs_sync']:.2f}x" if e["new_samples_per_s_vs_sync"] else "-"
        rows.append(
            f"{mode:<14}{e['engines']:>8.0f}{e['trainer_ranks']:>6.0f}{e['step_s']:>8.2f}{e['samples_per_s']:>10.1f}"
            f"{e['new_samples_per_s']:>10.1f}{vs:>8}{e['generated_tokens_per_s']:>11.0f}{e['trainer_idle']:>13.0%}"
            f"{e['generator_idle']:>9.0%}" + (f"{e['bubble_ratio']:>7.0%}" if e["bubble_ratio"] is not None
                                               else f"{'-':>7}")
            + f"{e['staleness_mean']:>6.2f}{e['replay_share']:>7.0%}"
            + (f"{e['est_time_to_target_s']:>18.1f}" if e.get("est_time_to_target_s") else f"{'-':>18}"))
    rows.append("* simulated: a bench's new samples to target / the simulated new samples per second "
                "(a simulator cannot learn)")
    cpu = [f"{mode} {e['control_cpu_s_per_step']:.3f} s" for mode, e in summary.items()
           if e.get("control_cpu_s_per_step") is not None]
    if cpu:
        rows.append("control plane CPU per step (this machine, the loops' own code): " + ", ".join(cpu))
    return "\n".join(rows)


def write_json(path: Path, results: list[SimResult], summary: dict, meta: dict,
               validation: dict | None = None) -> Path:
    data: dict[str, Any] = {"meta": meta, "summary": summary, "runs": [asdict(r) for r in results]}
    if validation is not None:
        data["validation"] = validation
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def plot(summary: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Three panels per mode: new samples per second, trainer and generator idle, time per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    x = range(len(modes))
    fig, (rate, idle, step) = plt.subplots(1, 3, figsize=(14, 4.2))
    rate.bar(x, [summary[m]["new_samples_per_s"] for m in modes], color="tab:blue")
    rate.set_title("new samples trained on per second")
    width = 0.4
    idle.bar([i - width / 2 for i in x], [summary[m]["trainer_idle"] for m in modes], width, label="trainer idle")
    idle.bar([i + width / 2 for i in x], [summary[m]["generator_idle"] for m in modes], width, label="generator idle")
    idle.set_ylim(0, 1)
    idle.legend()
    idle.set_title("idle share of the step (mean over steps)")
    step.bar(x, [summary[m]["step_s"] for m in modes], color="tab:green")
    step.set_title("seconds per step")
    for ax in (rate, idle, step):
        ax.set_xticks(list(x), modes, rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def real_figures(r: mode_bench.ModeResult) -> dict[str, float | None]:
    """A bench run's figures under ``FIGURES``' names."""
    return {"step_s": r.wall_s / max(r.steps, 1), "trainer_idle": r.trainer_idle, "generator_idle": r.generator_idle,
            "bubble_ratio": r.bubble_ratio, "generated_tokens_per_s": r.generated_tokens_per_s}


def validate(bench: list[mode_bench.ModeResult], sims: list[SimResult],
             tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Relative errors of the simulation against the bench, per mode, seed and figure (module docstring)."""
    rows = []
    for real in bench:
        sim = next((s for s in sims if s.mode == real.mode and s.seed == real.seed), None)
        if sim is None:
            continue
        for name, value in real_figures(real).items():
            simulated = getattr(sim, name)
            if value is None or simulated is None:
                continue
            error = abs(simulated - value) / abs(value) if value else (0.0 if simulated == 0 else float("inf"))
            rows.append({"mode": real.mode, "seed": real.seed, "figure": name, "bench": value,
                         "simulated": simulated, "error": error, "points": abs(simulated - value) if name in SHARES
                         else None, "within": error <= tolerance})
    if not rows:
        raise ValueError("validate: no mode and seed is in both the bench and the simulation")
    return {"tolerance": tolerance, "rows": rows, "within": sum(r["within"] for r in rows), "checked": len(rows),
            "max_error": max(r["error"] for r in rows), "passed": all(r["within"] for r in rows)}


def validation_table(v: dict[str, Any]) -> str:
    lines = [f"{'mode':<14}{'seed':>5}  {'figure':<24}{'bench':>10}{'simulated':>11}{'error':>8}{'points':>8}"]
    for r in v["rows"]:
        points = f"{r['points'] * 100:>8.1f}" if r.get("points") is not None else f"{'':>8}"
        lines.append(f"{r['mode']:<14}{r['seed']:>5}  {r['figure']:<24}{r['bench']:>10.3f}{r['simulated']:>11.3f}"
                     f"{r['error']:>7.0%}{points}{'' if r['within'] else ' !'}")
    lines.append(f"{v['within']} of {v['checked']} figures within {v['tolerance']:.0%} "
                 f"(largest error {v['max_error']:.0%}): {'PASS' if v['passed'] else 'FAIL'}")
    return "\n".join(lines)
