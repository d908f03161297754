"""The machine's CPU idle share from /proc/stat, and its run-level figure in the bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from reflow.bench import mode_bench
from reflow.infra import cpu
from reflow.infra.run import append_step
from reflow.storage.metrics import StepRecord


def test_the_aggregate_line_counts_idle_and_iowait_as_idle_and_leaves_steal_out() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    t = cpu.parse_cpu_line("cpu  100 20 30 400 50 5 10 999 7 0\n")
    assert t == cpu.CpuTimes(idle=450, total=615)  # 100+20+30+400+50+5+10; steal (999) and guest (in user) out
    after = cpu.CpuTimes(idle=450 + 30, total=615 + 120)
    assert cpu.idle_fraction(t, after) == pytest.approx(30 / 120)
    assert cpu.idle_fraction(t, t) is None  # no tick passed


@pytest.mark.parametrize("line", ["cpu0 1 2 3 4 5 6 7", "cpu 1 2 3", "intr 1 2 3 4 5 6 7 8"])
def test_anything_but_the_aggregate_line_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="aggregate cpu line"):
        cpu.parse_cpu_line(line)


def test_reading_a_stat_file_and_a_missing_one(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert cpu.read_cpu_times(stat) == cpu.CpuTimes(idle=9, total=28)
    assert cpu.read_cpu_times(tmp_path / "absent") is None
    if cpu.PROC_STAT.exists():  # this machine: ticks only go up
        first = cpu.read_cpu_times()
        assert first is not None and first.total >= first.idle >= 0


def test_step_cpu_idle_is_unknown_before_the_origin_and_measured_after(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from reflow.tasks import context

    stat = tmp_path / "stat"  # the machine's ticks as the step clock reads them: idle is the 4th and 5th field
    monkeypatch.setattr(context, "read_cpu_times", lambda: cpu.read_cpu_times(stat))
    run_dir = str(tmp_path / "run")
    stat.write_text("cpu  10 0 10 70 10 0 0 0 0 0\n")
    assert context.step_cpu_idle(run_dir) is None  # no origin marked in this process: no reading before
    context.mark_origin(run_dir, 0.0)
    stat.write_text("cpu  40 0 30 100 30 0 0 0 0 0\n")  # 100 ticks later, 50 of them idle (30 + 20)
    assert context.step_cpu_idle(run_dir) == pytest.approx(0.5)
    stat.write_text("cpu  130 0 30 110 30 0 0 0 0 0\n")  # since the last step: 100 ticks, 10 idle
    assert context.step_cpu_idle(run_dir) == pytest.approx(0.1)
    assert context.step_cpu_idle(run_dir) is None  # not one tick since: unknown, not 0 or 1


def test_step_cpu_idle_reads_this_machine(tmp_path: Path) -> None:
    from reflow.tasks import context

    assert cpu.PROC_STAT.exists()  # reflow runs on Linux (README, "Requirements")
    run_dir = str(tmp_path / "run")
    context.mark_origin(run_dir, 0.0)
    share = None
    for _ in range(200):  # busy until at least one tick of the machine passes (10 ms each)
        sum(i * i for i in range(200_000))
        if (share := context.step_cpu_idle(run_dir)) is not None:
            break
    assert share is not None and 0.0 <= share <= 1.0


def test_the_driver_s_cpu_share_is_its_process_time_over_the_machine_s(tmp_path: Path) -> None:
    import os
    import time

    from reflow.tasks import context

    run_dir = str(tmp_path / "driver")
    assert context.step_control_cpu(run_dir) == (None, None)  # no origin marked in this process
    context.mark_origin(run_dir, 0.0)
    start = time.process_time()
    while time.process_time() - start < 0.3:  # this thread busy: about one core's worth
        pass
    time.sleep(0.3)  # then idle as long
    share, server = context.step_control_cpu(run_dir)
    assert server is None  # no Prefect server started by this process
    cores = os.cpu_count() or 1
    assert 0.1 / cores < share < 0.75 / cores, share  # at most half of one core over the wall time; less when busy


def test_the_bench_weighs_each_step_s_idle_share_by_its_length(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    # a 1 s step with the cores 40% idle, a 3 s step 0% idle: 0.4 of 4 s, so 10% (the plain mean says 20%)
    for step, (idle, secs) in enumerate([(0.4, 1.0), (0.0, 3.0)]):
        m = {"eval_accuracy_baseline": 0.2, "eval_accuracy": 0.3, "machine_cpu_idle_fraction": idle,
             "step_seconds": secs, "trainer_idle_fraction": 0.5}
        append_step(run_dir, StepRecord(step=step, policy_version=step + 1, elapsed_s=float(step + 1), metrics=m))
    r = mode_bench.summarise("reflow", 0, run_dir, None)
    assert r.cpu_idle == pytest.approx(0.1)
    summary = mode_bench.aggregate([r])
    assert summary["reflow"]["cpu_idle"]["mean"] == pytest.approx(0.1)
    assert "cpu idle" in mode_bench.table(summary) and " 10%" in mode_bench.table(summary)
    old = tmp_path / "old"  # a run from before the metric: no figure, a dash in the table
    old.mkdir()
    append_step(old, StepRecord(step=0, policy_version=1, elapsed_s=1.0,
                                metrics={"eval_accuracy_baseline": 0.2, "eval_accuracy": 0.3, "step_seconds": 1.0}))
    r_old = mode_bench.summarise("sync", 0, old, None)
    assert r_old.cpu_idle is None and mode_bench.aggregate([r_old])["sync"]["cpu_idle"] is None
