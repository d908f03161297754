"""What a person sees: progress lines, the end-of-run table, the curves PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the environment says
import matplotlib.pyplot as plt  # noqa: E402

from reflow.storage.metrics import StepRecord, eval_points


def progress_line(rec: StepRecord, total_steps: int) -> str:
    m = rec.metrics
    line = (f"step {rec.step + 1:>4}/{total_steps}  reward {m.get('reward_mean', 0):.3f}  "
            f"acc {m.get('accuracy', 0):.3f}  len {m.get('response_length_mean', 0):5.1f}  "
            f"gen {m.get('generated_tokens_per_s', 0):7.0f} tok/s  train {m.get('trained_tokens_per_s', 0):6.0f} tok/s  "
            f"step {m.get('step_seconds', 0):5.1f}s  t={rec.elapsed_s:6.0f}s")
    if "eval_accuracy" in m:
        line += f"  eval_acc {m['eval_accuracy']:.3f}"
    return line


def summary_table(steps: list[StepRecord], max_rows: int = 12) -> str:
    """A fixed-width table of a subset of steps (first, evenly spaced, last) plus totals."""
    if not steps:
        return "no steps were run"
    stride = max(1, len(steps) // max_rows)
    chosen = steps[::stride]
    if chosen[-1] is not steps[-1]:
        chosen.append(steps[-1])
    head = f"{'step':>5} {'time_s':>7} {'reward':>7} {'acc':>6} {'eval_acc':>8} {'len':>6} {'gen_tok/s':>9} {'loss':>8}"
    rows = [head, "-" * len(head)]
    for r in chosen:
        m = r.metrics
        ev = f"{m['eval_accuracy']:.3f}" if "eval_accuracy" in m else "-"
        rows.append(f"{r.step + 1:>5} {r.elapsed_s:>7.0f} {m.get('reward_mean', 0):>7.3f} {m.get('accuracy', 0):>6.3f} "
                    f"{ev:>8} {m.get('response_length_mean', 0):>6.1f} {m.get('generated_tokens_per_s', 0):>9.0f} "
                    f"{m.get('loss', 0):>8.4f}")
    return "\n".join(rows)


def plot_curves(steps: list[StepRecord], path: Path, title: str) -> Path:
    """Reward and accuracy (train batches, held-out eval) against wall-clock time."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t = [r.elapsed_s for r in steps]
    ax.plot(t, [r.metrics.get("reward_mean", 0) for r in steps], label="train reward", alpha=0.6)
    ax.plot(t, [r.metrics.get("accuracy", 0) for r in steps], label="train accuracy", alpha=0.6)
    ev = eval_points(steps)
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", label="held-out accuracy", color="black")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
