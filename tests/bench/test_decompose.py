"""The speedup decomposition: data x utilisation x efficiency, and the machine's ceiling."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from reflow.bench import decompose, mode_bench
from tests.bench.test_mode_bench import _result


def _run(out: Path, mode: str, ttt: float | None, samples: float | None, cpu_idle: float | None,
         seed: int = 0) -> mode_bench.ModeResult:
    return dataclasses.replace(_result(out, mode, seed, ttt), samples_to_target=samples, cpu_idle=cpu_idle)


def test_decompose_by_hand() -> None:
    # sync: 2,000 samples in 40 s (50/s) with 20% of the machine idle; reflow: 2,500 in 25 s (100/s), none idle.
    # speedup 40/25 = 1.6 = data 2000/2500 (0.8) x utilisation 1.0/0.8 (1.25) x efficiency 1.6 (residual).
    sync, reflow = _run(Path("o"), "sync", 40.0, 2000.0, 0.2), _run(Path("o"), "reflow", 25.0, 2500.0, 0.0)
    parts = decompose.decompose(reflow, sync)
    assert parts == pytest.approx({"speedup": 1.6, "data": 0.8, "utilisation": 1.25, "efficiency": 1.6,
                                   "ceiling": 1.25})
    # efficiency is the ratio of new samples per busy machine-second: 100 / 1.0 against 50 / 0.8
    assert parts["efficiency"] == pytest.approx((2500 / 25 / 1.0) / (2000 / 40 / 0.8))


@pytest.mark.parametrize("field, value", [("time_to_target_s", None), ("time_to_target_s", 0.0),
                                          ("samples_to_target", None), ("cpu_idle", None), ("cpu_idle", 1.0)])
def test_decompose_needs_every_figure(field: str, value: float | None) -> None:
    sync, reflow = _run(Path("o"), "sync", 40.0, 2000.0, 0.2), _run(Path("o"), "reflow", 25.0, 2500.0, 0.0)
    assert decompose.decompose(reflow, sync) is not None
    assert decompose.decompose(dataclasses.replace(reflow, **{field: value}), sync) is None
    assert decompose.decompose(reflow, dataclasses.replace(sync, **{field: value})) is None


def test_speed_limits_per_seed_against_sync_and_the_fastest_baseline(tmp_path: Path) -> None:
    a = tmp_path / "a"
    results = [
        # seed 0: async (30 s) is the fastest baseline, one_step_off never reached the target
        _run(a, "sync", 40.0, 2000.0, 0.2), _run(a, "one_step_off", None, None, 0.1),
        _run(a, "async", 30.0, 3000.0, 0.0), _run(a, "reflow", 25.0, 2500.0, 0.0),
        # seed 1: sync is the fastest baseline; no CPU figures for async (an older run)
        _run(a, "sync", 20.0, 1000.0, 0.5, seed=1), _run(a, "async", 30.0, 1500.0, None, seed=1),
        _run(a, "reflow", 20.0, 1000.0, 0.0, seed=1),
    ]
    limits = decompose.speed_limits(results)
    s0, s1 = limits["per_seed"]
    assert (s0["seed"], s0["invocation"], s0["vs_sync"]["against"], s0["vs_best_baseline"]["against"]) == \
        (0, "a", "sync", "async")
    # 2x sync at a ceiling of 1.25 needs data x efficiency >= 2 x 0.8 = 1.6; reflow has 0.8 x 1.6 = 1.28
    assert s0["vs_sync"]["needed"] == pytest.approx(1.6) and s0["vs_sync"]["target"] == 2.0
    # against async: 30/25 = 1.2 = data 1.2 x utilisation 1.0 x efficiency 1.0; 1.3x needs 1.3
    assert s0["vs_best_baseline"] == pytest.approx({"against": "async", "speedup": 1.2, "data": 1.2,
                                                    "utilisation": 1.0, "efficiency": 1.0, "ceiling": 1.0,
                                                    "target": 1.3, "needed": 1.3})
    # seed 1: sync at half the machine idle: the ceiling is 2.0; 2x needs data x efficiency >= 1.0
    same = ("against", "speedup", "data", "utilisation", "efficiency", "ceiling")
    assert {k: s1["vs_sync"][k] for k in same} == {k: s1["vs_best_baseline"][k] for k in same}
    assert s1["vs_best_baseline"]["target"] == 1.3 and s1["vs_best_baseline"]["needed"] == pytest.approx(0.65)
    assert s1["vs_sync"]["ceiling"] == pytest.approx(2.0) and s1["vs_sync"]["needed"] == pytest.approx(1.0)
    assert s1["vs_sync"]["efficiency"] == pytest.approx(0.5)
    text = decompose.limits_table(limits)
    assert "a/s0 vs sync: 1.60x = data 0.80 x utilisation 1.25 (ceiling 1.25) x efficiency 1.60; " \
           "2.0x needs data x efficiency >= 1.60, has 1.28" in text
    assert "a/s0 vs async (best baseline): 1.20x = data 1.20 x utilisation 1.00 (ceiling 1.00)" in text
    assert "a/s1 vs sync (best baseline): 1.00x" in text


def test_limits_table_says_when_no_seed_has_the_figures(tmp_path: Path) -> None:
    results = [_run(tmp_path, "sync", 40.0, 2000.0, None), _run(tmp_path, "reflow", 25.0, 2500.0, None)]
    limits = decompose.speed_limits(results)
    assert "vs_sync" not in limits["per_seed"][0]
    assert "no seed with the figures" in decompose.limits_table(limits)


def test_data_factors_by_hand(tmp_path: Path) -> None:
    a, b = tmp_path / "base", tmp_path / "variant"

    def run(out: Path, mode: str, seed: int, samples: float | None, final: float) -> mode_bench.ModeResult:
        return dataclasses.replace(_result(out, mode, seed, 10.0 if samples else None, final),
                                   samples_to_target=samples)

    results = [
        # base/s0: async needs 2,400 new samples where sync needed 2,000 (0.83); reflow 1,600 (1.25)
        run(a, "sync", 0, 2000.0, 0.50), run(a, "async", 0, 2400.0, 0.49), run(a, "reflow", 0, 1600.0, 0.45),
        # base/s1: async never reached the target (data 0 in the median), reflow 1,000 against 3,000 (3.0)
        run(a, "sync", 1, 3000.0, 0.40), run(a, "async", 1, None, 0.30), run(a, "reflow", 1, 1000.0, 0.41),
        # variant/s0: its own sync is the reference
        run(b, "sync", 0, 1500.0, 0.50), run(b, "async", 0, 1000.0, 0.52),
    ]
    factors = decompose.data_factors(results)
    rows = {(r["invocation"], r["seed"], r["mode"]): r for r in factors["per_seed"]}
    assert rows[("base", 0, "async")]["data"] == pytest.approx(2000 / 2400)
    assert rows[("base", 0, "reflow")]["accuracy_vs_sync"] == pytest.approx(-0.05)
    assert rows[("base", 1, "async")]["data"] is None and rows[("base", 1, "reflow")]["data"] == pytest.approx(3.0)
    assert rows[("variant", 0, "async")]["data"] == pytest.approx(1.5)
    medians = {(m["invocation"], m["mode"]): m for m in factors["medians"]}
    assert medians[("base", "async")]["data_median"] == pytest.approx((2000 / 2400 + 0.0) / 2)
    assert medians[("base", "async")]["met"] is False
    # reflow: median data (1.25 + 3.0) / 2 over the 1.2 bar, but accuracy median (-0.05 + 0.01) / 2 = -0.02: met
    assert medians[("base", "reflow")]["data_median"] == pytest.approx(2.125)
    assert medians[("base", "reflow")]["accuracy_vs_sync_median"] == pytest.approx(-0.02)
    assert medians[("variant", "async")]["met"] is True
    text = decompose.data_table(factors)
    assert re.search(r"base/s1 +async +never +- +never +0\.300 +-0\.100", text)
    assert "base reflow: median data 2.12 over 2 seed(s)" in text


def test_repeats_of_a_variant_pool_by_seed(tmp_path: Path) -> None:
    def run(out: str, mode: str, seed: int, samples: float | None, final: float) -> mode_bench.ModeResult:
        return dataclasses.replace(_result(tmp_path / out, mode, seed, 10.0 if samples else None, final),
                                   samples_to_target=samples)

    results = [
        # first run: async 0.80 on seed 0 (2,000 / 2,500), 1.50 on seed 1 (3,000 / 2,000); median 1.15
        run("r1", "sync", 0, 2000.0, 0.50), run("r1", "async", 0, 2500.0, 0.52),
        run("r1", "sync", 1, 3000.0, 0.40), run("r1", "async", 1, 2000.0, 0.38),
        # second run: sync the same, async 1,500 on seed 0, never on seed 1
        run("r2", "sync", 0, 2000.0, 0.50), run("r2", "async", 0, 1500.0, 0.49),
        run("r2", "sync", 1, 3000.0, 0.40), run("r2", "async", 1, None, 0.30),
        # another variant, alone: not pooled
        run("v", "sync", 0, 2000.0, 0.50), run("v", "async", 0, 1000.0, 0.50),
    ]
    factors = decompose.data_factors(results, [["r1", "r2"], ["v"]])
    (pooled,) = factors["pooled"]
    assert pooled["invocations"] == ["r1", "r2"] and pooled["mode"] == "async"
    s0, s1 = pooled["per_seed"]
    # seed 0: mean sync 2,000 over mean async (2,500 + 1,500) / 2 = 2,000: 1.0; accuracy (+0.02 - 0.01) / 2
    assert s0["data"] == pytest.approx(1.0) and s0["accuracy_vs_sync"] == pytest.approx(0.005)
    # seed 1: one repeat never reached the target: no pooled factor (0 in the median)
    assert s1["data"] is None and s1["accuracy_vs_sync"] == pytest.approx((-0.02 - 0.10) / 2)
    assert pooled["data_median"] == pytest.approx(0.5) and pooled["met"] is False
    assert pooled["accuracy_vs_sync_median"] == pytest.approx((0.005 - 0.06) / 2)
    text = decompose.data_table(factors)
    assert "pooled over 2 repeats (r1, r2) async: data per seed 1.00 / never, median 0.50" in text
    assert "not met" in text.splitlines()[-1]
    assert decompose.data_factors(results)["pooled"] == []
