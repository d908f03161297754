"""What a person sees of a run: the progress line, the end-of-run table, the curves."""

from __future__ import annotations

from pathlib import Path

import pytest

from reflow.storage.metrics import StepRecord
from reflow.tasks import report


def _steps(n: int = 30) -> list[StepRecord]:
    out = []
    for s in range(n):
        m = {"reward_mean": 0.5, "accuracy": 0.5, "loss": 0.01, "entropy": 0.2, "generated_tokens_per_s": 100.0,
             "trained_tokens_per_s": 50.0, "trainer_idle_fraction": 0.7, "generator_idle_fraction": 0.3,
             "eval_accuracy_baseline": 0.3}
        if (s + 1) % 10 == 0:
            m["eval_accuracy"] = 0.3 + s / 100
        out.append(StepRecord(step=s, policy_version=s + 1, elapsed_s=2.0 * (s + 1), metrics=m))
    return out


def test_the_table_has_the_warm_start_and_every_evaluation() -> None:
    text = report.summary_table(_steps())
    lines = text.splitlines()
    assert "(warm start)" in lines[2] and "0.300" in lines[2]
    assert [line.split()[0] for line in lines[3:]] == ["1", "10", "20", "30"]  # first, each eval, last
    assert " acc " not in lines[0]  # reward and accuracy are the same here: one column
    steps = _steps()
    steps[4].metrics["accuracy"] = 0.25
    assert "acc" in report.summary_table(steps).splitlines()[0].split()


def test_the_progress_line_keeps_the_figures_and_shows_the_time_left() -> None:
    line = report.progress_line(_steps()[9], 30)
    assert line.startswith("step   10/30  reward 0.500") and "eval_acc 0.390" in line
    assert "33%|" in line and "ETA 00:40" in line  # 20 s for 10 steps: 40 s for the other 20


def test_the_curves_have_a_step_axis_and_four_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.image

    figures = []
    close = report.plt.close
    monkeypatch.setattr(report.plt, "close", lambda fig: (figures.append(fig), close(fig)))
    png = report.plot_curves(_steps(), tmp_path / "curves.png", "run")
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > height > 500  # the 2 x 2 figure was written
    (fig,) = figures
    assert [ax.get_title() for ax in fig.axes] == ["reward and accuracy", "loss, entropy, KL", "throughput",
                                                   "idle share of each step"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "", "step", "step"]
    learn = fig.axes[0]
    held = [line for line in learn.get_lines() if line.get_label() == "held-out accuracy"][0]
    assert list(held.get_xdata()) == [0, 10, 20, 30] and held.get_ydata()[0] == 0.3  # the warm start, 1-based steps
    idle_labels = {line.get_label() for line in fig.axes[3].get_lines()}
    assert idle_labels == {"trainer idle", "generator idle"}  # no machine CPU reading in these steps: not drawn
