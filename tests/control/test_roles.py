"""The stage-speed scheduler against synthetic stage speeds."""

from __future__ import annotations

import random

import pytest

from reflow.control.clock import VirtualClock
from reflow.control.roles import RoleScheduler, StageRates


def run(scheduler: RoleScheduler, clock: VirtualClock, windows: int, produced: float, trained: float, level: int,
        noise: float = 0.0, seed: int = 0, switch_s: float = 2.0) -> None:
    rng = random.Random(seed)
    for _ in range(windows):
        clock.advance(10.0)
        jitter = lambda x: max(0.0, x * (1 + rng.uniform(-noise, noise)))  # noqa: E731
        scheduler.decide(StageRates(jitter(produced), jitter(trained), level, batch_groups=16, switch_s=switch_s))


def test_generation_bottleneck_moves_workers_to_generation() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["train", "train", "generate"], clock, dwell_s=30.0)
    run(s, clock, windows=12, produced=1.0, trained=2.0, level=4)  # a quarter batch left and falling
    assert s.roles == ["generate", "generate", "generate"] and s.switches == 2
    assert all(d.role in (None, "generate") for d in s.decisions)


def test_training_bottleneck_moves_workers_to_training() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["generate", "generate"], clock, dwell_s=30.0)
    run(s, clock, windows=12, produced=3.0, trained=1.0, level=80)  # five batches waiting and rising
    assert s.roles == ["train", "train"]
    assert "rising" in s.decisions[-1].reason or "no worker free" in s.decisions[-1].reason


def test_a_steady_state_never_switches() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["generate", "train"], clock, dwell_s=30.0)
    run(s, clock, windows=50, produced=2.0, trained=2.0, level=32, noise=0.3)
    assert s.switches == 0


def test_a_level_outside_the_band_already_heading_back_moves_nothing() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["generate", "train"], clock, dwell_s=30.0)
    run(s, clock, windows=10, produced=3.0, trained=2.0, level=2)  # low, but refilling
    run(s, clock, windows=10, produced=1.0, trained=2.0, level=90)  # high, but draining
    assert s.switches == 0


@pytest.mark.parametrize("seed", range(5))
def test_at_most_one_switch_per_dwell_window_under_noisy_rates(seed: int) -> None:
    clock = VirtualClock()
    s = RoleScheduler(["generate", "train", "generate", "train"], clock, dwell_s=30.0)
    rng = random.Random(seed)
    for _ in range(200):  # rates and level jump around the band
        clock.advance(10.0)
        s.decide(StageRates(rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.randint(0, 100), 16, switch_s=1.0))
    times = [d.at for d in s.decisions if d.workers]
    assert all(len(d.workers) <= 1 for d in s.decisions)  # max_moves = 1
    assert times and all(b - a >= 30.0 for a, b in zip(times, times[1:]))


def test_a_switch_that_costs_more_than_it_can_win_is_not_made() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["train", "train"], clock, dwell_s=30.0)
    # 5% imbalance: the fast stage waits 1.5 s per 30 s dwell, the switch costs 4 s
    run(s, clock, windows=10, produced=1.9, trained=2.0, level=4, switch_s=4.0)
    assert s.switches == 0 and "switch cost" in s.decisions[-1].reason
    run(s, clock, windows=1, produced=1.0, trained=2.0, level=4, switch_s=4.0)  # 50%: 15 s to win
    assert s.switches == 1


def test_bad_bands_are_refused() -> None:
    with pytest.raises(ValueError, match="low"):
        RoleScheduler(["train"], VirtualClock(), low=3, high=1)


def test_a_buffer_pinned_outside_the_band_moves_a_worker_by_the_measured_wait() -> None:
    """Produced equals trained, so the trend alone sees nothing to win: an empty buffer with a waiting trainer
    (generation is the bottleneck) and a full one with idle engines (the gate holds them back) still move a
    worker, because the measured wait over a dwell exceeds the switch's cost; without a wait nothing moves."""
    clock = VirtualClock()
    s = RoleScheduler(["train", "generate"], clock, low=0.5, high=1.5, dwell_s=30.0)
    clock.advance(30.0)
    held = s.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0))
    assert held.workers == () and "switch cost" in held.reason
    moved = s.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0, trainer_wait=0.4))
    assert (moved.workers, moved.role) == ((0,), "generate")
    clock.advance(30.0)
    assert s.decide(StageRates(2.0, 2.0, 32, 16, switch_s=1.0, generator_wait=0.0)).workers == ()
    moved = s.decide(StageRates(2.0, 2.0, 32, 16, switch_s=1.0, generator_wait=0.3))
    assert moved.role == "train" and s.trainers == 1


def test_the_alternate_policy_switches_every_dwell_whatever_the_rates() -> None:
    clock = VirtualClock()
    s = RoleScheduler(["generate", "train"], clock, dwell_s=10.0, policy="alternate")
    run(s, clock, windows=10, produced=2.0, trained=2.0, level=24)  # steady: the band rule would hold
    # windows at 10, 20, ... 100 s, one dwell apart: a switch in each, the worker longest in its role first
    assert s.switches == 10
    assert [(d.workers, d.role) for d in s.decisions if d.workers][:3] == [
        ((0,), "train"), ((1,), "generate"), ((0,), "generate")]


def test_a_large_pool_moves_as_many_workers_as_close_the_wait() -> None:
    """max_moves > 1: the trainer waited 40% of the window, so 4 fixed engines must run 1 / 0.6 times as fast:
    4 * 0.4 / 0.6 = 2.67, three more generators, in one decision. Then the dwell holds; a smaller wait later
    (20%, over 7 generators: 1.75) moves two, and never more than max_moves or the workers free to move."""
    clock = VirtualClock()
    s = RoleScheduler(["train"] * 8, clock, low=0.5, high=1.5, dwell_s=30.0, max_moves=6, fixed_generators=4)
    clock.advance(30.0)
    moved = s.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0, trainer_wait=0.4))
    assert (moved.workers, moved.role) == ((0, 1, 2), "generate") and s.switches == 3
    assert "workers 0, 1, 2 -> generate" in moved.reason
    clock.advance(10.0)
    assert s.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0, trainer_wait=0.4)).workers == ()  # the dwell
    clock.advance(20.0)
    assert s.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0, trainer_wait=0.2)).workers == (3, 4)
    clock.advance(30.0)
    capped = RoleScheduler(["train"] * 8, clock, low=0.5, high=1.5, dwell_s=30.0, max_moves=2, fixed_generators=4)
    clock.advance(30.0)
    assert capped.decide(StageRates(2.0, 2.0, 0, 16, switch_s=1.0, trainer_wait=0.9)).workers == (0, 1)
    # towards training the slow stage is the trainer (one rank): engines idle 30% -> 1 * 0.3 / 0.7 = 0.43, one
    s2 = RoleScheduler(["generate"] * 4, clock, low=0.5, high=1.5, dwell_s=30.0, max_moves=4, fixed_generators=4)
    clock.advance(30.0)
    assert s2.decide(StageRates(2.0, 2.0, 32, 16, switch_s=1.0, generator_wait=0.3)).workers == (0,)
    clock.advance(30.0)  # now two train (the rank and worker 0): 2 * 0.6 / 0.4 = 3, the three left
    assert s2.decide(StageRates(2.0, 2.0, 32, 16, switch_s=1.0, generator_wait=0.6)).workers == (1, 2, 3)
    with pytest.raises(ValueError, match="max_moves"):
        RoleScheduler(["train"], VirtualClock(), max_moves=0)
