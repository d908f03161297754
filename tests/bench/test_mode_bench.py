"""The benchmark's arithmetic: time to target, default target, speedups, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflow.bench import mode_bench
from reflow.infra.run import append_step
from reflow.storage.metrics import StepRecord

FIXTURE_BENCH = Path(__file__).resolve().parents[1] / "fixtures" / "sim" / "bench.json"


def test_time_to_target_interpolates_between_eval_points() -> None:
    curve = [(0.0, 0.2), (10.0, 0.3), (20.0, 0.5)]
    assert mode_bench.time_to_target(curve, 0.4) == pytest.approx(15.0)
    assert mode_bench.time_to_target(curve, 0.3) == pytest.approx(10.0)
    assert mode_bench.time_to_target(curve, 0.1) == 0.0
    assert mode_bench.time_to_target(curve, 0.6) is None


def _run(tmp_path: Path, name: str, evals: dict[int, float], seconds_per_step: float, extra: dict) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    for step in range(6):
        m = {"eval_accuracy_baseline": 0.2, "generated_tokens": 100.0, "trained_tokens": 50.0, **extra}
        if step in evals:
            m["eval_accuracy"] = evals[step]
        append_step(run_dir, StepRecord(step=step, policy_version=step + 1, elapsed_s=(step + 1) * seconds_per_step,
                                        metrics=m))
    return run_dir


def test_summaries_targets_and_speedups(tmp_path: Path) -> None:
    sync = mode_bench.summarise("sync", 0, _run(tmp_path, "s", {2: 0.3, 5: 0.6}, 10.0,
                                           {"trainer_idle_fraction": 0.5, "rollout_seconds": 2.0}), None)
    assert sync.wall_s == 60.0 and sync.generated_tokens_per_s == pytest.approx(600 / 60)
    assert sync.engine_tokens_per_s == pytest.approx(600 / 12)  # tokens per second of engine time
    assert sync.eval_curve == [(0.0, 0.2), (30.0, 0.3), (60.0, 0.6)]
    target = mode_bench.default_target(sync)
    assert target == pytest.approx(0.2 + 0.75 * 0.4)  # 0.5
    fast = mode_bench.summarise("reflow", 0, _run(tmp_path, "r", {2: 0.5, 5: 0.6}, 5.0,
                                             {"trainer_idle_fraction": 0.1, "replay_share": 0.4}), None)
    mid = mode_bench.summarise("async", 0, _run(tmp_path, "a", {2: 0.4, 5: 0.6}, 6.0, {"engine_tokens_per_s": 400.0}),
                          None)
    assert mid.engine_tokens_per_s == pytest.approx(400.0)
    results = [mode_bench.with_target(r, target) for r in (sync, mid, fast)]
    assert results[0].time_to_target_s == pytest.approx(30 + 30 * (0.2 / 0.3))  # 50 s
    assert results[2].time_to_target_s == pytest.approx(15.0)
    summary = mode_bench.aggregate(results)
    assert summary["reflow"]["speedup_vs_sync"] == pytest.approx(50 / 15)
    # best baseline: async reaches 0.5 at 18 + 18 * (0.1 / 0.2) = 27 s
    assert summary["reflow"]["speedup_vs_best_baseline"] == pytest.approx(27 / 15)
    assert summary["reflow"]["replay_share"]["mean"] == pytest.approx(0.4)
    text = mode_bench.table(summary)
    assert "reflow" in text and "3.33x" in text
    shares = mode_bench.by_share(results, (0.5, 0.9))
    # sync gained 0.4: targets 0.4 (sync at 30 + 30 * 0.1 / 0.3 = 40 s, reflow at 15 * 0.2 / 0.3 = 10 s) and 0.56
    assert shares["0.5"]["sync"][0] == pytest.approx(40.0) and shares["0.5"]["reflow"][0] == pytest.approx(10.0)
    assert shares["0.9"]["sync"][0] == pytest.approx(56.0) and shares["0.9"]["reflow"][0] == pytest.approx(24.0)
    assert "s0 10.0 (4.00x)" in mode_bench.share_table(shares) and "s0 24.0 (2.33x)" in mode_bench.share_table(shares)
    assert mode_bench.by_share([r for r in results if r.mode != "sync"]) == {"0.5": {}, "0.75": {}, "0.9": {}}
    path = mode_bench.write_json(tmp_path / "bench.json", results, summary, {"seeds": [0]}, shares)
    assert path.read_text().count('"mode"') == 3
    assert json.loads(path.read_text())["time_to_share_of_sync_gain"]["0.9"]["reflow"]["0"] == pytest.approx(24.0)


def test_trainer_idle_over_the_wall_clock_weighs_steps_by_their_length(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    # a 1 s step idle 50% and a 3 s step idle 10%: busy 0.5 + 2.7 of 4 s, so 20% idle (the plain mean says 30%)
    for step, (idle, secs) in enumerate([(0.5, 1.0), (0.1, 3.0)]):
        m = {"eval_accuracy_baseline": 0.2, "eval_accuracy": 0.3, "trainer_idle_fraction": idle, "step_seconds": secs}
        append_step(run_dir, StepRecord(step=step, policy_version=step + 1, elapsed_s=float(step + 1), metrics=m))
    r = mode_bench.summarise("reflow", 0, run_dir, None)
    assert r.trainer_idle == pytest.approx(0.3) and r.trainer_idle_wall == pytest.approx(0.2)
    assert mode_bench.aggregate([r])["reflow"]["trainer_idle_wall"]["mean"] == pytest.approx(0.2)
    assert "20%" in mode_bench.table(mode_bench.aggregate([r]))
    assert mode_bench.trainer_idle_wall([StepRecord(step=0, policy_version=1, elapsed_s=1.0, metrics={})]) == 0.0


def test_a_mode_that_never_reaches_the_target(tmp_path: Path) -> None:
    slow = mode_bench.summarise("sync", 0, _run(tmp_path, "s", {5: 0.25}, 10.0, {}), 0.5)
    assert slow.time_to_target_s is None
    summary = mode_bench.aggregate([slow])
    assert summary["sync"]["time_to_target_s"] is None and summary["sync"]["seeds_reaching_target"] == 0
    assert "0/1 hit" in mode_bench.table(summary)


def test_summarise_rejects_runs_without_steps_or_evals(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="no steps"):
        mode_bench.summarise("sync", 0, tmp_path / "empty", None)
    run_dir = tmp_path / "noeval"
    run_dir.mkdir()
    append_step(run_dir, StepRecord(step=0, policy_version=1, elapsed_s=1.0, metrics={}))
    with pytest.raises(RuntimeError, match="no held-out"):
        mode_bench.summarise("sync", 0, run_dir, None)


def test_the_bubble_is_averaged_over_rounds_that_opened(tmp_path: Path) -> None:
    """A sorted step whose batch the rollout cache held opened no round: it does not dilute the bubble's mean."""
    run_dir = tmp_path / "p"
    run_dir.mkdir()
    for step, (tokens, bubble) in enumerate([(100.0, 0.10), (0.0, 0.0), (100.0, 0.04), (100.0, 0.07)]):
        m = {"eval_accuracy_baseline": 0.2, "generated_tokens": tokens, "rollout_bubble_ratio": bubble,
             **({"eval_accuracy": 0.3} if step == 3 else {})}
        append_step(run_dir, StepRecord(step=step, policy_version=step + 1, elapsed_s=step + 1.0, metrics=m))
    assert mode_bench.summarise("sorted_partial", 0, run_dir, None).bubble_ratio == pytest.approx(0.07)
    assert mode_bench.summarise("async", 0, _run(tmp_path, "a", {5: 0.3}, 1.0, {}), None).bubble_ratio is None


def test_smoothed_curve_is_a_trailing_mean() -> None:
    curve = [(0.0, 0.2), (10.0, 0.5), (20.0, 0.3), (30.0, 0.45), (40.0, 0.5)]
    line = mode_bench.smoothed(curve, 3)
    assert [t for t, _ in line] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert [a for _, a in line] == pytest.approx([0.2, 0.35, 1 / 3, 1.25 / 3, 1.25 / 3])
    assert mode_bench.smoothed(curve, 1) == curve
    # one lucky evaluation at 10 s crosses 0.4 alone; the trailing mean crosses between 20 and 30 s
    assert mode_bench.time_to_target(curve, 0.4) == pytest.approx(10 * 0.2 / 0.3)
    assert mode_bench.time_to_target(line, 0.4) == pytest.approx(20 + 10 * (0.4 - 1 / 3) / (1.25 / 3 - 1 / 3))
    with pytest.raises(ValueError, match="smooth_evals"):
        mode_bench.smoothed(curve, 0)


def test_summarise_with_smoothing_averages_the_last_evaluations(tmp_path: Path) -> None:
    r = mode_bench.summarise("sync", 0, _run(tmp_path, "s", {1: 0.3, 3: 0.5, 5: 0.4}, 10.0, {}), 0.35, smooth_evals=2)
    assert r.final_accuracy == pytest.approx(0.45) and r.final_accuracy_last == pytest.approx(0.4)
    # trailing means of two: 0.2, 0.25, 0.4 (at 40 s), 0.45 -> 0.35 is crossed at 20 + 20 * (0.1 / 0.15)
    assert r.time_to_target_s == pytest.approx(20 + 20 * (0.1 / 0.15))
    assert mode_bench.with_target(r, 0.45).time_to_target_s == pytest.approx(60.0)
    assert mode_bench.default_target(r) == pytest.approx(0.2 + 0.75 * 0.25)


def test_equal_data_gives_reflow_the_steps_its_new_groups_need_and_new_samples_are_counted(tmp_path: Path) -> None:
    """Every mode gets 30 batches' worth of new groups; reflow (16 new of 32 at least) up to 60 steps."""
    assert mode_bench.equal_data(30, 32, 32) == ["run.max_new_groups=960", "run.total_steps=30"]
    assert mode_bench.equal_data(30, 32, 16) == ["run.max_new_groups=960", "run.total_steps=60"]
    assert mode_bench.equal_data(30, 32, 11) == ["run.max_new_groups=960", "run.total_steps=88"]  # rounded up
    rounds = mode_bench.summarise("sync", 0, _run(tmp_path, "s", {5: 0.3}, 1.0, {"samples": 64.0}), None)
    streaming = mode_bench.summarise("reflow", 0, _run(tmp_path, "r", {5: 0.3}, 1.0, {
        "samples": 64.0, "fresh_samples": 24.0, "stale_samples": 8.0, "replayed_samples": 32.0}), None)
    assert (rounds.new_samples, streaming.new_samples) == (6 * 64, 6 * 32)
    assert mode_bench.aggregate([streaming])["reflow"]["new_samples"]["mean"] == 6 * 32


def test_a_rows_overrides_are_the_ones_its_run_and_the_up_front_check_read(tmp_path: Path) -> None:
    """``row_overrides``: what ``bench_mode`` passes its ``reflow run`` and ``check_rows`` validates before any row
    runs; a row whose own config is invalid, or whose run directory is taken, is named."""
    sets = mode_bench.row_overrides(None, ["run.total_steps=4"], "sorted_partial", 3, equal_steps=True)
    assert sets == ["run.total_steps=4", 'mode.kind="sync"', 'rollout.scheduling="sorted_partial"', "run.seed=3",
                    "eval.deferred=true", 'run.name="bench-sorted_partial-s3"']
    assert "run.max_new_groups=" in " ".join(mode_bench.row_overrides(None, [], "reflow", 0, equal_steps=False))
    mode_bench.check_rows(None, [], ["sync", "reflow"], [0, 1], tmp_path, equal_steps=False)
    with pytest.raises(ValueError, match="mode sorted_on_policy, seed 1"):
        mode_bench.check_rows(None, ['env.kind="tool_calc"'], ["sync", "sorted_on_policy"], [1], tmp_path, False)
    (tmp_path / "runs" / "reflow-s1").mkdir(parents=True)
    mode_bench.check_rows(None, [], ["reflow"], [1], tmp_path, False)  # an empty one is reused
    (tmp_path / "runs" / "reflow-s1" / "r").mkdir()
    with pytest.raises(ValueError, match="reflow-s1"):
        mode_bench.check_rows(None, [], ["sync", "reflow"], [1], tmp_path, False)
    for key in mode_bench.ROW_FIELDS:  # a row sets these after the user's --set: refused, not silently replaced
        with pytest.raises(ValueError, match=f"--set {key}: the bench sets it for each row"):
            mode_bench.check_rows(None, [f"{key} = 1"], ["sync"], [2], tmp_path, False)
        assert key in " ".join(mode_bench.row_overrides(None, [], "sorted_partial", 2, equal_steps=True))


def test_load_meta_and_results_name_a_bench_json_that_is_not_one(tmp_path: Path) -> None:
    for data, what in (({"runs": []}, "meta"), ({"runs": [], "meta": []}, "meta"),
                       ({"runs": [], "meta": {"overrides": [1]}}, "meta.overrides")):
        (tmp_path / "bench.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=what):
            mode_bench.load_meta(tmp_path)
    (tmp_path / "bench.json").write_text(json.dumps({"runs": ["x"]}))
    with pytest.raises(ValueError, match="runs"):
        mode_bench.load_results(tmp_path)
    good = json.loads(FIXTURE_BENCH.read_text())["runs"][0]
    for field, value, said in (("final_accuracy", None, "final_accuracy: Input should be a valid number"),
                               ("wall_s", "abc", "wall_s"), ("eval_curve", "abc", "eval_curve"),
                               ("mode", "bogus", "'bogus' is not a bench mode")):
        (tmp_path / "bench.json").write_text(json.dumps({"runs": [good, {**good, field: value}]}))
        with pytest.raises(ValueError, match=rf"(?s)runs\[1\].*{said}"):
            mode_bench.load_results(tmp_path)
    (tmp_path / "bench.json").write_text(json.dumps({"runs": [{k: v for k, v in good.items() if k != "seed"}]}))
    with pytest.raises(ValueError, match="seed: Field required"):
        mode_bench.load_results(tmp_path)


def test_samples_to_target_splits_time_to_target_into_data_and_rate(tmp_path: Path) -> None:
    """The data curve counts new samples only; time to target = samples to target / new samples per second."""
    # six steps of 5 s; each trains 24 fresh + 8 stale (new) and 32 replayed samples; evaluations after steps 1 and 3
    r = mode_bench.summarise("reflow", 0, _run(tmp_path, "r", {1: 0.3, 3: 0.5}, 5.0, {
        "samples": 64.0, "fresh_samples": 24.0, "stale_samples": 8.0, "replayed_samples": 32.0}), 0.4)
    assert r.eval_curve == [(0.0, 0.2), (10.0, 0.3), (20.0, 0.5)]
    assert r.data_curve == [(0.0, 0.2), (64.0, 0.3), (128.0, 0.5)]  # 2 and 4 steps of 32 new samples
    assert r.time_to_target_s == pytest.approx(15.0) and r.samples_to_target == pytest.approx(96.0)
    assert r.new_samples_per_s_to_target == pytest.approx(96.0 / 15.0)
    # the same learning per new sample at half the rate: twice the time, the same data
    slow = mode_bench.summarise("async", 0, _run(tmp_path, "a", {1: 0.3, 3: 0.5}, 10.0, {"samples": 32.0}), 0.4)
    assert slow.samples_to_target == pytest.approx(96.0) and slow.time_to_target_s == pytest.approx(30.0)
    never = mode_bench.with_target(r, 0.9)
    assert never.samples_to_target is None and never.new_samples_per_s_to_target is None
    summary = mode_bench.aggregate([r, slow])
    assert summary["reflow"]["samples_to_target"]["mean"] == pytest.approx(96.0)
    assert summary["async"]["new_samples_per_s_to_target"]["mean"] == pytest.approx(3.2)
    assert mode_bench.aggregate([never])["reflow"]["samples_to_target"] is None
    assert "96" in mode_bench.table(summary) and "6.4" in mode_bench.table(summary)
    path = mode_bench.write_json(tmp_path / "bench.json", [r, slow], summary, {})
    runs = json.loads(path.read_text())["runs"]
    assert runs[0]["data_curve"][2] == [128.0, 0.5] and runs[1]["new_samples_per_s_to_target"] == pytest.approx(3.2)
    assert mode_bench.plot([r, slow], tmp_path / "bench.png").stat().st_size > 0


def _result(out: Path, mode: str, seed: int, ttt: float | None, final: float = 0.4) -> mode_bench.ModeResult:
    """A summarised run as ``reflow bench --output OUT`` lays it out (only what ``seed_speedups`` reads matters)."""
    return mode_bench.ModeResult(mode=mode, seed=seed, run_dir=str(out / "runs" / f"{mode}-s{seed}" / "run"), steps=30,
                            wall_s=60.0, baseline_accuracy=0.2, final_accuracy=final, target_accuracy=0.35,
                            time_to_target_s=ttt, generated_tokens_per_s=1.0, engine_tokens_per_s=1.0,
                            trained_tokens_per_s=1.0, trainer_idle=0.1, generator_idle=0.1, staleness_mean=0.0,
                            replay_share=0.0, bubble_ratio=None, eval_curve=[(0.0, 0.2), (60.0, final)])


def test_seed_speedups_are_ratios_within_each_seed_of_each_invocation(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    results = [
        # a/s0: async is the fastest baseline (12 s); reflow 8 s: 1.5x it, 2.5x sync (20 s)
        _result(a, "sync", 0, 20.0, 0.40), _result(a, "one_step_off", 0, 15.0), _result(a, "async", 0, 12.0),
        _result(a, "reflow", 0, 8.0, 0.42),
        # a/s1: reflow never reaches the target that sync reached: 0.0 against both
        _result(a, "sync", 1, 30.0), _result(a, "async", 1, None), _result(a, "reflow", 1, None),
        # b/s0 (the same seed, another invocation): no baseline reached it, reflow did
        _result(b, "sync", 0, None), _result(b, "async", 0, None), _result(b, "reflow", 0, 40.0),
    ]
    out = mode_bench.seed_speedups(results)
    first, second, third = out["per_seed"]
    assert (first["invocation"], first["seed"], first["best"]) == ("a", 0, "async")
    assert first["vs_best_baseline"] == pytest.approx(1.5) and first["vs_sync"] == pytest.approx(2.5)
    assert first["vs_best_baseline_met"] and first["vs_sync_met"]
    assert first["final_accuracy"] == 0.42 and first["sync_final_accuracy"] == 0.40
    assert (second["best"], second["vs_sync"], second["vs_best_baseline"]) == ("sync", 0.0, 0.0)
    assert not second["vs_sync_met"] and not second["vs_best_baseline_met"]
    assert (third["invocation"], third["best"], third["vs_sync"], third["vs_best_baseline"]) == ("b", None, None, None)
    assert third["vs_sync_met"] and third["vs_best_baseline_met"]  # reached where no baseline did
    spread = out["spread"]
    assert spread["seeds"] == 3
    assert spread["vs_best_baseline"] == {"target": 1.3, "met": 2, "median": 0.75, "min": 0.0, "max": 1.5}
    assert spread["vs_sync"] == {"target": 2.0, "met": 2, "median": 1.25, "min": 0.0, "max": 2.5}
    at_start = mode_bench.seed_speedups([_result(a, "sync", 0, 0.0), _result(a, "reflow", 0, 0.0),
                                    _result(b, "sync", 0, 5.0), _result(b, "reflow", 0, 0.0)])["per_seed"]
    assert [e["vs_sync"] for e in at_start] == [1.0, float("inf")]  # warm start already at the target
    text = mode_bench.seed_table(out)
    assert "a/s0: 8.0 s, 1.50x the best baseline (async), 2.50x sync; final 0.420 (sync 0.400)" in text
    assert "b/s0: 40.0 s, no baseline reached, - sync" in text
    assert "against the best baseline: median 0.75x (0.00x to 1.50x), 2 of 3 seeds at 1.3x or more" in text


def test_bench_json_round_trips_and_bench_report_reads_several(tmp_path: Path) -> None:
    import subprocess
    import sys

    for name, ttt in (("a", 8.0), ("b", 16.0)):
        out = tmp_path / name
        out.mkdir()
        results = [_result(out, "sync", 0, 20.0), _result(out, "reflow", 0, ttt)]
        mode_bench.write_json(out / "bench.json", results, mode_bench.aggregate(results), {"seeds": [0]},
                         speedups=mode_bench.seed_speedups(results))
        assert mode_bench.load_results(out) == results
        assert json.loads((out / "bench.json").read_text())["reflow_by_seed"]["per_seed"][0]["vs_sync"] == \
            pytest.approx(20.0 / ttt)
    cli = [sys.executable, "-m", "reflow.cli.main", "bench-report"]
    done = subprocess.run([*cli, str(tmp_path / "a"), str(tmp_path / "b" / "bench.json"), "--output",
                           str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a/s0: 8.0 s, 2.50x the best baseline (sync), 2.50x sync" in done.stdout
    assert "b/s0: 16.0 s, 1.25x the best baseline (sync), 1.25x sync" in done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["spread"]["vs_sync"]["met"] == 1 and len(report["limits"]["per_seed"]) == 2
    assert "speedup = data x utilisation x efficiency" in done.stdout
    assert "data factor against sync" in done.stdout and len(report["data"]["per_seed"]) == 4
    # the same meta in both: repeats of one variant, pooled (neither has samples to target: no factor)
    assert [p["invocations"] for p in report["data"]["pooled"]] == [["a", "b"]]
    assert "pooled over 2 repeats (a, b) reflow: data per seed never" in done.stdout
    (tmp_path / "bad.json").write_text("{}")
    for args, message in (([str(tmp_path / "nowhere")], "no bench.json there"),
                          ([str(tmp_path / "bad.json")], "not a bench.json"),
                          ([str(tmp_path / "a"), "--output", str(tmp_path)], "must be a file")):
        done = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_repeat_key_names_the_variant(tmp_path: Path) -> None:
    meta = {"config": "configs/bench.toml", "config_text": "[run]\n", "overrides": ["eval.every_steps=3"],
            "modes": ["sync", "async"], "seeds": [21], "targets": {"21": 0.27}}
    keys = {}
    for name, change in (("same", {}), ("again", {"config": "elsewhere/bench.toml"}),
                         ("override", {"overrides": ["train.is_level=sequence"]}), ("target", {"targets": {"21": 0.3}}),
                         ("text", {"config_text": "[run]\nseed = 1\n"}),
                         ("comment", {"config_text": "# measured 2026-12-05\n[run]\n"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps({"meta": {**meta, **change}, "runs": []}))
        keys[name] = mode_bench.repeat_key(tmp_path / name)
    # the text the runs read decides, not where the file was
    assert keys["same"] == keys["again"] == keys["comment"]
    assert len({keys[k] for k in ("same", "override", "target", "text")}) == 4
    (tmp_path / "old.json").write_text(json.dumps({"meta": {k: v for k, v in meta.items() if k != "config_text"}}))
    (tmp_path / "old2.json").write_text(json.dumps({"meta": {**{k: v for k, v in meta.items() if k != "config_text"},
                                                             "config": "b.toml"}}))
    assert mode_bench.repeat_key(tmp_path / "old.json") != mode_bench.repeat_key(tmp_path / "old2.json")
    (tmp_path / "nometa.json").write_text(json.dumps({"runs": []}))
    assert mode_bench.repeat_key(tmp_path / "nometa.json") is None
