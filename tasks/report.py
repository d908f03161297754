"""What a person sees: progress lines, the end-of-run table, the curves PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the environment says
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reflow.storage.metrics import StepRecord


def progress_line(rec: StepRecord, total_steps: int) -> str:
    """One step's figures, then a progress bar with the time left (tqdm's meter, printed as a line so logs and
    the Prefect UI keep every step)."""
    m = rec.metrics
    line = (f"step {rec.step + 1:>4}/{total_steps}  reward {m.get('reward_mean', 0):.3f}  "
            f"acc {m.get('accuracy', 0):.3f}  len {m.get('response_length_mean', 0):5.1f}  "
            f"gen {m.get('generated_tokens_per_s', 0):7.0f} tok/s  "
            f"train {m.get('trained_tokens_per_s', 0):6.0f} tok/s  "
            f"step {m.get('step_seconds', 0):5.1f}s  t={rec.elapsed_s:6.0f}s")
    if "eval_accuracy" in m:
        line += f"  eval_acc {m['eval_accuracy']:.3f}"
    meter = tqdm.format_meter(min(rec.step + 1, total_steps), total_steps, rec.elapsed_s,
                              bar_format="{percentage:3.0f}%|{bar:12}| ETA {remaining}")
    return f"{line}  {meter}"


def summary_table(steps: list[StepRecord]) -> str:
    """The first and last steps and every evaluated one, the warm start's held-out accuracy first."""
    if not steps:
        return "no steps were run"
    chosen = [r for i, r in enumerate(steps) if i in (0, len(steps) - 1) or "eval_accuracy" in r.metrics]
    same = all(r.metrics.get("reward_mean") == r.metrics.get("accuracy") for r in steps)  # arith: one column
    acc_head = "" if same else f" {'acc':>6}"
    head = (f"{'step':>5} {'time_s':>7} {'reward':>7}{acc_head} {'eval_acc':>8} {'len':>6} {'gen_tok/s':>9} "
            f"{'loss':>8}")
    rows = [head, "-" * len(head)]
    baseline = steps[0].metrics.get("eval_accuracy_baseline")
    if baseline is not None:
        rows.append(f"{'0':>5} {0:>7.0f} {'-':>7}{'' if same else f' {chr(45):>6}'} {baseline:>8.3f} "
                    f"{'':>6} {'':>9} {'':>8}  (warm start)")
    for r in chosen:
        m = r.metrics
        ev = f"{m['eval_accuracy']:.3f}" if "eval_accuracy" in m else "-"
        acc = "" if same else f" {m.get('accuracy', 0):>6.3f}"
        rows.append(f"{r.step + 1:>5} {r.elapsed_s:>7.0f} {m.get('reward_mean', 0):>7.3f}{acc} {ev:>8} "
                    f"{m.get('response_length_mean', 0):>6.1f} {m.get('generated_tokens_per_s', 0):>9.0f} "
                    f"{m.get('loss', 0):>8.4f}")
    return "\n".join(rows)


def _series(steps: list[StepRecord], key: str) -> tuple[list[int], list[float]]:
    """(1-based steps, values) of the steps that logged ``key``."""
    pairs = [(r.step + 1, r.metrics[key]) for r in steps if key in r.metrics]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_curves(steps: list[StepRecord], path: Path, title: str) -> Path:
    """Four panels against the step: reward and accuracy (train, held-out), loss/entropy/KL, throughput, idle."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (learn, loss), (speed, idle) = axes
    for key, label, style in (("reward_mean", "train reward", "-"), ("accuracy", "train accuracy", "--")):
        learn.plot(*_series(steps, key), style, label=label, alpha=0.6)
    held_x, held_y = _series(steps, "eval_accuracy")
    baseline = steps[0].metrics.get("eval_accuracy_baseline") if steps else None
    if baseline is not None:
        held_x, held_y = [0, *held_x], [baseline, *held_y]
    if held_x:
        learn.plot(held_x, held_y, "o-", color="black", label="held-out accuracy")
    learn.set_ylim(0, 1)
    learn.set_title("reward and accuracy")
    for key, label in (("loss", "loss"), ("entropy", "entropy"), ("kl", "KL to the reference")):
        if any(key in r.metrics for r in steps):
            loss.plot(*_series(steps, key), label=label)
    loss.set_title("loss, entropy, KL")
    for key, label in (("generated_tokens_per_s", "generated tokens/s"), ("trained_tokens_per_s",
                                                                         "trained tokens/s")):
        speed.plot(*_series(steps, key), label=label)
    speed.set_title("throughput")
    for key, label in (("trainer_idle_fraction", "trainer idle"), ("generator_idle_fraction", "generator idle"),
                       ("machine_cpu_idle_fraction", "machine CPU idle")):
        if any(key in r.metrics for r in steps):
            idle.plot(*_series(steps, key), label=label)
    idle.set_ylim(0, 1)
    idle.set_title("idle share of each step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
