"""The AIMD concurrency controller of the streaming feeder: decisions on hand-made windows."""

from __future__ import annotations

import pytest

from reflow.control.concurrency import ConcurrencyController


def test_controller_increases_then_backs_off_and_ignores_unsaturated_windows() -> None:
    ctl = ConcurrencyController(initial=64, minimum=32, maximum=160, increase=32, decrease=0.5, window_s=1.0)
    assert ctl.observe(tokens=1000, busy_s=1.0, saturated=True) == 96  # first window: probe up
    assert ctl.observe(tokens=1500, busy_s=1.0, saturated=True) == 128  # +50% on 64's 1000: keep going
    assert ctl.observe(tokens=3000, busy_s=1.0, saturated=False) == 128  # limited by the gate: no decision
    assert ctl.observe(tokens=1700, busy_s=1.0, saturated=True) == 160  # +13% on 96's 1500
    assert ctl.observe(tokens=1000, busy_s=1.0, saturated=True) == 80  # -41% on 128's 1700: the move hurt, halve
    assert ctl.observe(tokens=200, busy_s=0.5, saturated=True) == 80  # window not full yet
    assert ctl.observe(tokens=900, busy_s=0.5, saturated=True) == 80  # 1100 tok/s, not below 160's 1000: hold
    assert [d[2] for d in ctl.decisions] == ["probe", "increase", "increase", "decrease", "hold"]


def test_controller_reverses_a_back_off_that_hurt_and_floors_the_target() -> None:
    ctl = ConcurrencyController(initial=64, minimum=32, maximum=256, increase=32, decrease=0.5, window_s=1.0)
    ctl.observe(1000, 1.0, True)  # probe -> 96
    assert ctl.observe(800, 1.0, True) == 48  # the probe hurt: halve
    assert ctl.observe(500, 1.0, True) == 80  # and so did the back-off (-37% on 800): up again
    assert ctl.observe(300, 1.0, True) == 40  # the move up hurt (-40% on 500): halve
    assert ctl.observe(100, 1.0, True) == 72  # the back-off hurt: up
    assert ctl.observe(10, 1.0, True) == 36  # hurt: halve
    assert ctl.observe(10, 1.0, True) == 36  # flat after the back-off: hold
    low = ConcurrencyController(initial=40, minimum=32, maximum=256, increase=8, decrease=0.5, window_s=1.0)
    low.observe(1000, 1.0, True)  # -> 48
    assert low.observe(100, 1.0, True) == 32  # floor
    assert [d[2] for d in low.decisions] == ["probe", "decrease"]


def test_controller_does_not_back_off_on_noise_at_an_unchanged_target() -> None:
    """Windows at one target only measure it; a fall between two of them moves nothing."""
    ctl = ConcurrencyController(initial=128, minimum=32, maximum=256, increase=32, window_s=1.0, patience=3)
    ctl.observe(2000, 1.0, True)  # probe -> 160
    assert ctl.observe(2040, 1.0, True) == 160  # +2% on 128's 2000: hold
    assert ctl.observe(1500, 1.0, True) == 160  # -26% on the window before, at the same target: still hold
    assert ctl.observe(2400, 1.0, True) == 192  # third window at 160: probe (mean 1980 is the reference)
    assert ctl.observe(2050, 1.0, True) == 192  # +3.5% on 1980: hold
    assert [d[2] for d in ctl.decisions] == ["probe", "hold", "hold", "probe", "hold"]


def test_controller_probes_after_flat_windows_and_checks_bounds() -> None:
    ctl = ConcurrencyController(initial=64, minimum=32, maximum=96, increase=32, window_s=1.0, patience=2)
    ctl.observe(1000, 1.0, True)  # -> 96
    ctl.observe(1000, 1.0, True)  # flat after the move: hold
    assert ctl.observe(1000, 1.0, True) == 96  # two windows at 96: probe, capped at the maximum
    assert ctl.decisions[-1][2] == "probe"
    assert ctl.observe(1000, 1.0, True) == 96 and ctl.decisions[-1][2] == "hold"  # measured afresh
    with pytest.raises(ValueError, match="minimum"):
        ConcurrencyController(initial=8, minimum=16, maximum=32, increase=1)
