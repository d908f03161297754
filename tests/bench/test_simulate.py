"""``reflow simulate``: the scheduler's virtual time, the cost models, and the modes run against them."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from reflow.bench.sim_clock import Deadlock, SimScheduler
from reflow.bench.sim_profile import (
    DriverCost,
    EngineCost,
    Lengths,
    MachineCost,
    SimProfile,
    SyncCost,
    TrainerCost,
    load_profile,
)
from reflow.bench.sim_report import aggregate, summarise, validate
from reflow.bench.simulate import EnginePool, config_path, mode_config, simulate
from reflow.cli.main import main
from reflow.cli.simulate import DEFAULT_PROFILE, PACKAGE
from reflow.config.load import config_to_json, load_config


def profile(lengths: list[list[int]] | None = None, rewards: list[list[float]] | None = None, *,
            base: float = 0.01, per_seq: float = 0.0, token_s: float = 0.001, trainer_base: float = 0.0,
            load: float = 0.0, score: float = 0.0) -> SimProfile:
    return SimProfile(
        name="test",
        engine=EngineCost(source="test", step_base_s=base, per_seq_s=per_seq, weight_load_s=load),
        trainer=TrainerCost(source="test", step_base_s=trainer_base, token_s=token_s),
        sync=SyncCost(source="test", fixed_s=0.0, bytes=0, bytes_per_s=1.0),
        driver=DriverCost(source="test", round_score_s=score),
        lengths=Lengths(source="test", prompt_tokens=4, groups=lengths or [[3, 5]], group_rewards=rewards))


# the scheduler


def test_threads_take_turns_in_virtual_time_and_the_order_is_the_same_every_time() -> None:
    def trace() -> list[tuple[str, float]]:
        sched, seen = SimScheduler(), []

        def worker(name: str, pause: float) -> None:
            for _ in range(3):
                sched.sleep(pause)
                seen.append((name, sched.now()))

        def main() -> None:
            a, b = sched.spawn(lambda: worker("a", 0.3), "a"), sched.spawn(lambda: worker("b", 0.5), "b")
            sched.join(a)
            sched.join(b)

        sched.run(main)
        return seen

    first = trace()
    assert first == [("a", 0.3), ("b", 0.5), ("a", 0.6), ("a", pytest.approx(0.9)), ("b", 1.0), ("b", 1.5)]
    assert all(trace() == first for _ in range(5))


def test_a_notify_wakes_the_waiter_at_the_notifier_time_and_a_timeout_at_its_own() -> None:
    sched = SimScheduler()
    cond = sched.condition()
    woke: list[tuple[bool, float]] = []

    def waiter() -> None:
        with cond:
            woke.append((cond.wait(timeout=10.0), sched.now()))
            woke.append((cond.wait(timeout=2.0), sched.now()))

    def main() -> None:
        task = sched.spawn(waiter, "waiter")
        sched.sleep(1.5)
        with cond:
            cond.notify_all()
        sched.join(task)

    sched.run(main)
    assert woke == [(True, 1.5), (False, 3.5)]


def test_every_thread_waiting_forever_is_a_deadlock_not_a_hang() -> None:
    sched = SimScheduler()
    cond = sched.condition()
    with pytest.raises(Deadlock):
        sched.run(lambda: cond.wait())


# the engine model


def test_a_round_takes_the_modelled_steps_and_tokens_carry_the_engine_version() -> None:
    prof = profile([[3, 5]], base=0.01, per_seq=0.001)
    pool = EnginePool(prof, engines=1, max_sequences=8, samples=2, rng=np.random.default_rng(0),
                      max_response_tokens=100)
    pool.engines[0].version = 4
    pool.submit([0])
    w = pool.step(0.0, math.inf)
    # 3 steps with 2 sequences, then 2 with 1: 3 * (0.01 + 0.002) + 2 * (0.01 + 0.001)
    assert w.end == pytest.approx(0.058) and w.busy_s == pytest.approx(0.058)
    assert sorted(s.length for s in w.finished) == [3, 5] and {s.version for s in w.finished} == {4}
    assert w.slot_s == pytest.approx(3 * 2 * 0.012 + 2 * 0.011)



def test_the_decode_steps_solved_at_once_are_the_ones_taken_one_at_a_time() -> None:
    """Between finishes the engine's steps are solved as a series; a step-by-step loop over the same cost takes the
    same number of steps to the same time, across costs, loads and windows."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        base, per_seq, per_token = rng.uniform(0, 0.02), rng.uniform(0, 1e-3), rng.choice([0.0, rng.uniform(0, 1e-5)])
        prof = profile(base=base, per_seq=per_seq)
        prof.engine.per_context_token_s = per_token
        pool = EnginePool(prof, engines=1, max_sequences=8, samples=2, rng=rng, max_response_tokens=100)
        n, context, slow = int(rng.integers(1, 300)), float(rng.integers(1, 5000)), rng.uniform(1, 3)
        room, most = rng.uniform(0, 5), int(rng.integers(1, 20000))
        steps, t = 0, 0.0
        while steps < most and t < room:  # what EnginePool._run did before
            t += prof.engine.step_s(n, context + n * steps, 0) * slow
            steps += 1
        k = pool._decode_steps(n, context, slow, room, most)
        assert k == steps and pool._decode_s(n, context, slow, k) == pytest.approx(t, rel=1e-9)
    assert pool._decode_steps(5, 10.0, 1.0, math.inf, 7) == 7  # a window without end: to the next finish

def test_a_window_ends_after_the_step_that_crosses_it_and_new_weights_load_before_it() -> None:
    prof = profile([[10, 10]], base=0.1, load=0.05)
    pool = EnginePool(prof, engines=1, max_sequences=8, samples=2, rng=np.random.default_rng(0),
                      max_response_tokens=100)
    pool.submit([0])
    first = pool.step(0.0, 0.25)
    assert first.end == pytest.approx(0.3) and not first.finished  # 3 steps of 0.1: the third starts at 0.2
    pool.push(1, arrives=0.3)
    second = pool.step(first.end, 0.25)
    assert second.end == pytest.approx(0.3 + 0.05 + 0.3) and second.busy_s == pytest.approx(0.3)
    rest = pool.step(second.end, math.inf)
    assert [s.version for s in rest.finished] == [0, 0]  # the oldest token's version


def test_groups_go_to_the_least_loaded_engine_and_measured_rewards_stay_with_their_lengths() -> None:
    prof = profile([[3, 3], [7, 7]], [[1.0, 1.0], [0.0, 1.0]])
    pool = EnginePool(prof, engines=2, max_sequences=8, samples=2, rng=np.random.default_rng(1),
                      max_response_tokens=100)
    pool.submit([0, 1, 2, 3])
    assert [e.requests for e in pool.engines] == [4, 4]
    done = pool.step(0.0, math.inf).finished
    for s in done:
        assert (s.length == 3) == (not s.trained)  # the all-correct group has no advantage: skipped


def test_a_request_given_back_credits_each_engine_the_tokens_it_generated() -> None:
    prof = profile([[10, 10]], base=0.1)
    pool = EnginePool(prof, engines=2, max_sequences=8, samples=2, rng=np.random.default_rng(0),
                      max_response_tokens=100)
    pool.submit([0], to=1)
    first = pool.step(0.0, 0.25)  # 3 steps: 3 tokens of each sample on engine 1
    pool.release(1)
    second = pool.step(first.end, 0.25)
    assert [(engine, tokens) for engine, _, tokens in second.released] == [(1, 3), (1, 3)]
    assert [request[2:4] for _, request, _ in second.released] == [(7, 3), (7, 3)]  # 7 to go, 3 generated
    pool.resubmit([request for _, request, _ in second.released], to=0)
    done = pool.step(second.end, math.inf).finished
    assert [(s.engine, s.length, s.resumed) for s in done] == [(0, 10, 3), (0, 10, 3)]
    pool.submit([1], to=0)  # a request that never moved came with nothing
    assert {s.resumed for s in pool.step(0.0, math.inf).finished} == {0}


def test_an_abandoned_group_frees_its_slots_and_the_others_finish_at_their_own_lengths() -> None:
    """Two slots, three groups: dropping the running group mid-way admits the next into its slots (their context
    starting at the prompt), and sequences finishing at the same step come out in admission order."""
    prof = profile([[6, 6], [2, 9], [4, 4]], base=0.1, per_seq=0.0)  # drawn as below with this seed
    pool = EnginePool(prof, engines=1, max_sequences=2, samples=2, rng=np.random.default_rng(0),
                      max_response_tokens=100)
    pool.submit([0, 1, 2], to=0)
    assert {g: pool.group_lengths(g).tolist() for g in range(3)} == {0: [4, 4], 1: [6, 6], 2: [2, 9]}
    first = pool.step(0.0, 0.25)  # 3 steps of group 0: 3 of its 4 tokens each
    assert not first.finished and pool.in_flight == 6
    pool.abandon([0])
    assert pool.in_flight == 4
    rest = pool.step(first.end, math.inf)
    # group 1 from step 3 to 9 (both at once); group 2 then: sample 0 ends at step 11, sample 1 at 18
    assert [(s.group, s.sample, s.length) for s in rest.finished] == [(1, 0, 6), (1, 1, 6), (2, 0, 2), (2, 1, 9)]
    assert rest.end == pytest.approx(1.8) and pool.in_flight == 0


def test_a_lognormal_profile_matches_its_stated_quantiles() -> None:
    lengths = Lengths(source="test", prompt_tokens=100, p50=3000, p99=16000, max=20480)
    rng = np.random.default_rng(0)
    drawn = np.concatenate([lengths.group(rng, 16)[0] for _ in range(4000)])
    assert np.median(drawn) == pytest.approx(3000, rel=0.05)
    assert np.quantile(drawn, 0.99) == pytest.approx(16000, rel=0.1)
    assert drawn.max() <= 20480


# the modes


def small(mode: str, **extra: str):
    sets = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "run.total_steps=12",
            "concurrency.initial_sequences=32", "concurrency.min_sequences=8", "concurrency.increase=8",
            "rollout.max_concurrent_sequences=64", "buffer.max_staleness_versions=3", "buffer.replay_ratio=0.5",
            *[f"{k}={v}" for k, v in extra.items()]]
    return mode_config(None, sets, mode, 0, equal_steps=True)


def test_sync_step_is_round_plus_score_plus_update_plus_sync_exactly() -> None:
    prof = profile([[5, 5, 5, 5]], [[1.0, 0.0, 1.0, 0.0]], base=0.01, token_s=0.001, trainer_base=0.1, load=0.2,
                   score=0.05)
    run = simulate(small("sync"), prof, seed=0)
    round_s, train_s = 5 * 0.01, 0.1 + 8 * 4 * 5 * 0.001
    assert [s.step_seconds for s in run.steps[1:]] == pytest.approx([round_s + 0.05 + train_s + 0.2] * 11)
    assert all(s.staleness_mean == 0 for s in run.steps)


def test_one_step_off_trains_one_version_behind_and_overlaps_the_round() -> None:
    prof = profile([[5, 5, 5, 5]], [[1.0, 0.0, 1.0, 0.0]], base=0.01, token_s=0.001, trainer_base=0.1)
    sync, off = simulate(small("sync"), prof, 0), simulate(small("one_step_off"), prof, 0)
    assert [s.staleness_mean for s in off.steps[1:]] == [1.0] * 11
    assert off.steps[-1].elapsed_s < sync.steps[-1].elapsed_s


@pytest.mark.parametrize("mode", ["async", "reflow"])
def test_streaming_modes_run_the_real_loops_within_their_bounds_and_repeat_exactly(mode: str) -> None:
    prof = profile([[3, 9, 4, 30], [12, 12, 2, 5], [40, 41, 1, 2]], [[1, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]],
                   base=0.005, per_seq=0.0002, token_s=0.0005, trainer_base=0.05)
    cfg = small(mode)
    run = simulate(cfg, prof, seed=3)
    assert len(run.steps) == 12
    assert max(s.staleness_mean for s in run.steps) <= cfg.buffer.max_staleness_versions
    assert all(s.replay_share <= (0.5 if mode == "reflow" else 0.0) + 1e-9 for s in run.steps)
    again = simulate(cfg, prof, seed=3)
    assert [s.step_seconds for s in again.steps] == [s.step_seconds for s in run.steps]
    other = simulate(cfg, prof, seed=4)
    assert [s.step_seconds for s in other.steps] != [s.step_seconds for s in run.steps]


def test_a_batch_not_prefetched_is_read_on_the_trainers_path() -> None:
    """``trainer.read_s`` delays a step whose batch the selector chose after the step before ended, and no other:
    the run is longer, by less than ``read_s`` a step, and its trainer idles more."""
    prof = profile([[3, 9, 4, 30], [12, 12, 2, 5]], [[1, 0, 1, 0], [1, 1, 0, 1]], base=0.005, per_seq=0.0002,
                   token_s=0.0005, trainer_base=0.05)
    slow = prof.model_copy(update={"trainer": prof.trainer.model_copy(update={"read_s": 0.2})})
    runs = [summarise(simulate(small("reflow"), p, 0)) for p in (prof, slow)]
    extra, steps = runs[1].wall_s - runs[0].wall_s, small("reflow").planned_steps()
    assert 0.0 < extra < 0.2 * steps and runs[1].trainer_idle > runs[0].trainer_idle


def test_more_engines_make_more_samples_when_generation_is_the_bottleneck() -> None:
    prof = profile([[30, 60, 90, 120]], [[1, 0, 1, 0]], base=0.02, per_seq=0.001, token_s=1e-5)
    rates = [summarise(simulate(small("async", **{"resources.engines": str(n)}), prof, 0)).new_samples_per_s
             for n in (1, 4)]
    assert rates[1] > 2.5 * rates[0]


def _tail_profile() -> SimProfile:
    """Groups with a long tail: most responses 4-6 tokens, one in four of some groups 100-120."""
    return profile([[5, 5, 5, 100], [4, 6, 5, 5], [5, 120, 5, 6]], [[1, 0, 1, 0], [1, 1, 0, 0], [0, 1, 0, 0]],
                   base=0.01, per_seq=0.0001, token_s=0.0005)


def test_busy_actors_beyond_the_cores_slow_each_other() -> None:
    """``machine``: up to ``cores`` busy actors the measured factors hold; beyond, each one's compute takes
    ``(busy / cores) ** oversubscription`` longer. Four engines and a trainer on two cores generate more than one
    engine does, but less than four engines each on its own device."""
    assert MachineCost(source="t").factor(9) == 1.0  # unset: every actor has its own device
    shared = MachineCost(source="t", cores=2)
    assert [shared.factor(n) for n in (1, 2, 3, 5)] == pytest.approx([1.0, 1.0, 1.5, 2.5])
    assert MachineCost(source="t", cores=2, oversubscription=2).factor(3) == pytest.approx(2.25)
    prof = profile([[30, 60, 90, 120]], [[1, 0, 1, 0]], base=0.02, per_seq=0.001, token_s=1e-4)
    on_cores = prof.model_copy(update={"machine": shared})
    rate = {(n, p is on_cores): summarise(simulate(small("async", **{"resources.engines": str(n)}), p, 0))
            for n in (1, 4) for p in (prof, on_cores)}
    assert rate[(1, True)].new_samples_per_s == rate[(1, False)].new_samples_per_s  # two actors on two cores
    assert rate[(1, True)].new_samples_per_s < rate[(4, True)].new_samples_per_s < rate[(4, False)].new_samples_per_s


def test_sorted_rounds_run_the_real_scheduler_and_cut_the_bubble() -> None:
    prof = _tail_profile()
    plain = simulate(small("sync"), prof, 0)
    on_policy, partial = simulate(small("sorted_on_policy"), prof, 0), simulate(small("sorted_partial"), prof, 0)
    assert (on_policy.mode, partial.mode) == ("sorted_on_policy", "sorted_partial")  # named by their bench rows
    bubble = lambda run: statistics.fmean(s.bubble_ratio for s in run.steps)  # noqa: E731
    assert bubble(plain) > 0.5  # a round waits for its longest response
    # partial resumes the long ones next round; on_policy restarts them and, after max_aborts rounds, waits for them
    assert bubble(partial) < bubble(plain) / 2 and bubble(on_policy) < bubble(plain)
    assert all(s.staleness_mean == 0 for s in on_policy.steps)  # incomplete groups are dropped, never resumed
    assert any(s.staleness_mean > 0 for s in partial.steps)  # resumed responses keep their older tokens
    assert all(s.samples == 8 * 4 for s in partial.steps)  # one step's worth of groups per round
    assert sum(s.generated_tokens for s in partial.steps) < sum(s.generated_tokens for s in on_policy.steps)
    again = simulate(small("sorted_partial"), prof, 0)
    assert [s.step_seconds for s in again.steps] == [s.step_seconds for s in partial.steps]


def test_sorted_rounds_pool_several_engines() -> None:
    run = simulate(small("sorted_partial", **{"resources.engines": "2"}), _tail_profile(), 0)
    assert run.engines == 2 and len(run.steps) == 12 and all(s.samples == 32 for s in run.steps)
    with pytest.raises(ValueError, match="mode sync only"):
        simulate(load_config(None, ['mode.kind="async"', 'rollout.scheduling="sorted_partial"']), _tail_profile(), 0)


def test_shipped_profiles_load_and_say_where_every_figure_comes_from() -> None:
    for path in [DEFAULT_PROFILE, *sorted((PACKAGE / "configs" / "profiles").glob("*.toml"))]:
        prof = load_profile(path)
        for part in (prof.engine, prof.trainer, prof.sync, prof.driver, prof.lengths):
            assert len(part.source) > 20, f"{path}: {type(part).__name__} needs its source"


def test_validation_measures_relative_errors_and_fails_outside_the_tolerance() -> None:
    from reflow.bench.mode_bench import ModeResult

    real = ModeResult(mode="sync", seed=0, run_dir="x", steps=10, wall_s=20.0, baseline_accuracy=0.3,
                      final_accuracy=0.4, target_accuracy=None, time_to_target_s=None, generated_tokens_per_s=1000.0,
                      engine_tokens_per_s=0.0, trained_tokens_per_s=0.0, trainer_idle=0.5, generator_idle=0.4,
                      staleness_mean=0.0, replay_share=0.0, bubble_ratio=0.5, eval_curve=[])
    prof = profile([[5, 5, 5, 5]], [[1.0, 0.0, 1.0, 0.0]], base=0.01, token_s=0.001, trainer_base=0.1)
    sim = summarise(simulate(small("sync"), prof, 0))
    v = validate([real], [sim])
    assert v["checked"] == 5 and {r["figure"] for r in v["rows"]} >= {"step_s", "bubble_ratio"}
    step = next(r for r in v["rows"] if r["figure"] == "step_s")
    assert step["error"] == pytest.approx(abs(sim.step_s - 2.0) / 2.0)
    assert v["passed"] == all(r["error"] <= 0.15 for r in v["rows"])
    assert aggregate([sim])["sync"]["new_samples_per_s_vs_sync"] == pytest.approx(1.0)


def test_cli_refuses_bad_input_with_a_message(tmp_path, capsys) -> None:
    out = str(tmp_path / "o")
    assert main(["simulate", "--modes", "sync,warp", "--output", out]) == 2
    assert "warp" in capsys.readouterr().err
    assert main(["simulate", "--validate", str(tmp_path), "--output", out]) == 2
    assert "no bench.json" in capsys.readouterr().err
    bad = tmp_path / "p.toml"
    bad.write_text('name = "x"\n[engine]\nsource = "s"\nstep_base_s = -1\n')
    assert main(["simulate", "--profile", str(bad), "--output", out]) == 2
    assert "p.toml" in capsys.readouterr().err
    yaml = tmp_path / "p.yaml"
    yaml.write_text(bad.read_text())
    assert main(["simulate", "--profile", str(yaml), "--output", out]) == 2
    assert "p.yaml: expected a .toml or .json file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_writes_sim_json_table_and_png(tmp_path, capsys) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(profile([[3, 9, 4, 30], [12, 12, 2, 5]], [[1, 0, 1, 0], [1, 1, 1, 1]], base=0.005,
                            per_seq=0.0002, token_s=0.0005).model_dump_json())
    sets = ["--set", "rollout.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4", "--set",
            "run.total_steps=6", "--set", "buffer.replay_ratio=0.5"]
    assert main(["simulate", "--profile", str(prof), "--modes", "sync,reflow", "--seeds", "0,1", *sets,
                 "--output", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "reflow" in printed and "new smp/s" in printed
    import json

    data = json.loads((tmp_path / "o" / "sim.json").read_text())
    assert {(r["mode"], r["seed"]) for r in data["runs"]} == {("sync", 0), ("sync", 1), ("reflow", 0), ("reflow", 1)}
    assert (tmp_path / "o" / "sim.png").stat().st_size > 10_000


def test_a_simulation_imports_no_torch_ray_prefect_or_vllm(tmp_path) -> None:
    """The issue's "no Ray, Prefect or torch in the loop": the modes run in a fresh interpreter, then its modules."""
    import subprocess
    import sys

    prof = tmp_path / "p.json"
    prof.write_text(profile([[3, 9, 4, 30]], [[1, 0, 1, 0]], base=0.005, token_s=0.0005).model_dump_json())
    code = ("import sys\nfrom reflow.cli.main import main\n"
            f"assert main(['simulate', '--profile', {str(prof)!r}, '--modes', 'sync,one_step_off,async,reflow,"
            f"sorted_partial', '--set', 'run.total_steps=3', '--output', {str(tmp_path / 'o')!r}]) == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'prefect', 'vllm'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]


# calibration


SYNTHETIC_SETS = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "run.total_steps=8",
                  "concurrency.min_sequences=8", "concurrency.initial_sequences=32"]


def _synthetic_bench(root, engine=(0.004, 2e-4, 1e-6), trainer=(0.3, 5e-4), slow_train=1.3, slow_engine=1.5,
                     given_up=None):
    """A bench output whose runs' timings follow known cost models: sync rounds run the engine alone, the other
    modes' steps compute ``slow_train`` times slower, one_step_off rounds run ``slow_engine`` times slower while
    the step before trains. ``given_up``: stream position -> lengths of the samples that finished of a group the
    async run gave up in flight instead of writing it (``append_given_up``, one line per length)."""
    import json as _json

    from reflow.bench.mode_bench import ModeResult, write_json
    from reflow.infra.run import RunRecord, append_given_up
    from reflow.storage.delta_store import DeltaTrajectoryStore
    from reflow.storage.schema import Trajectory

    rng = np.random.default_rng(0)
    results = []
    for mode in ("sync", "one_step_off", "async"):
        run_dir = root / "runs" / mode
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(RunRecord(
            run_id=mode, run_dir=str(run_dir), store_root=str(run_dir / "tables"), model_dir="m", namespace="n",
            engines=("e",), trainer="t", tracking_uri="x", weight_bytes=4096).model_dump_json())
        (run_dir / "config.json").write_text(config_to_json(load_config(None, ["resources.num_cpus=3",
                                                                            "rollout.samples_per_prompt=4"])))
        rows, lines, before = [], [], 0.0
        for step in range(8):
            lengths = rng.integers(5, 60, size=(4, 4))
            rewards = rng.integers(0, 2, size=(4, 4)).astype(float)
            prompts = 7
            for g in range(4):
                if mode == "async" and step * 4 + g in (given_up or {}):
                    for n in given_up[step * 4 + g]:
                        append_given_up(run_dir, {step * 4 + g: [n]})
                    continue
                for k in range(4):
                    n = int(lengths[g, k])
                    rows.append(Trajectory(
                        trajectory_id=f"{mode}/{step}/{g}/{k}", run_id=mode, prompt_id=f"p{step}-{g}",
                        group_id=f"{mode}/g{step * 4 + g}/p{step}-{g}", sample_index=k, env="arith", rollout_step=step,
                        policy_version=step, prompt_tokens=[1] * prompts, response_tokens=[5] * n,
                        behaviour_logprobs=[-0.1] * n, token_versions=[step] * n, loss_mask=[1] * n,
                        reward=float(rewards[g, k]), correct=False, finish_reason="stop", response_length=n))
            flat = lengths.ravel().astype(float)
            alone = (engine[0] * flat.max() + engine[1] * flat.sum()
                     + engine[2] * float(np.sum(prompts * flat + flat * (flat + 1) / 2)))
            tokens = float(flat.sum())
            compute = (trainer[0] + trainer[1] * tokens) * (1.0 if mode == "sync" else slow_train)
            rollout = alone + (slow_engine - 1) * min(before, alone) if mode == "one_step_off" and step else alone
            step_s = rollout + compute + 0.5
            m = {"step_seconds": step_s, "trainer_idle_fraction": 1 - compute / step_s, "trained_tokens": tokens,
                 "update_seconds": compute + 0.05}
            if mode != "async":
                m |= {"rollout_seconds": rollout, "sync_weights_seconds": 0.08, "score_seconds": 0.12}
            else:
                m |= {"trainer_batch_prefetched": float(step % 2), "trainer_read_seconds": 0.07 * (1 - step % 2),
                      "select_seconds": 0.02, "write_seconds": 0.09, "writes": 3, "generated_tokens": tokens,
                      "engine_tokens_per_s": 900.0, "generator_idle_fraction": 0.1, "concurrency_target": 64}
            lines.append(_json.dumps({"step": step, "policy_version": step + 1, "elapsed_s": 3.0 * (step + 1),
                                      "metrics": m}))
            before = compute
        DeltaTrajectoryStore(str(run_dir / "tables")).append_trajectories(rows, app_id="w", txn_version=0)
        (run_dir / "steps.jsonl").write_text("\n".join(lines) + "\n")
        results.append(ModeResult(mode=mode, seed=0, run_dir=str(run_dir), steps=8, wall_s=24.0, baseline_accuracy=0.3,
                                  final_accuracy=0.4, target_accuracy=0.35, time_to_target_s=10.0,
                                  generated_tokens_per_s=1.0, engine_tokens_per_s=1.0, trained_tokens_per_s=1.0,
                                  trainer_idle=0.5, generator_idle=0.5, staleness_mean=0.0, replay_share=0.0,
                                  bubble_ratio=None, eval_curve=[(0.0, 0.3)]))
    write_json(root / "bench.json", results, {}, {"config": None, "overrides": SYNTHETIC_SETS})
    return root


def test_calibration_recovers_the_cost_models_the_runs_followed(tmp_path) -> None:
    from reflow.bench.sim_calibrate import bench_traces, calibrate, with_traces

    prof = calibrate(_synthetic_bench(tmp_path))
    e, t = prof.engine, prof.trainer
    assert (e.step_base_s, e.per_seq_s, e.per_context_token_s) == pytest.approx((0.004, 2e-4, 1e-6), rel=1e-3)
    assert (t.step_base_s, t.token_s) == pytest.approx((0.3, 5e-4), rel=1e-6)
    assert t.slowdown_while_generating == pytest.approx(1.3) and e.slowdown_while_training == pytest.approx(1.5)
    assert e.weight_load_s == pytest.approx(0.08) and prof.driver.write_s == pytest.approx(0.03)
    assert prof.driver.select_s == pytest.approx(0.02) and prof.driver.round_score_s == pytest.approx(0.12)
    assert t.overhead_s == pytest.approx(0.05) and prof.sync.bytes == 4096
    assert t.read_s == pytest.approx(0.07)  # the steps whose batch was not prefetched (after the first)
    assert (prof.machine.cores, prof.machine.oversubscription) == (3, 1.0)  # the runs' resources.num_cpus
    assert len(prof.lengths.groups) == 3 * 8 * 4 and prof.lengths.prompt_tokens == pytest.approx(7)
    assert all(len(g) == 4 for g in prof.lengths.groups)
    assert set(prof.lengths.by_run) == {"sync:0", "one_step_off:0", "async:0"}
    assert len(prof.lengths.by_run["sync:0"].lengths) == 8 * 4  # a run's own groups, each whole
    # the streaming engine: simulated with the fitted profile, replaying the run's groups, the async run's engine
    # makes the measured 900 tokens per busy second
    sim = simulate(mode_config(None, SYNTHETIC_SETS, "async", 0, equal_steps=False),
                   with_traces(prof, bench_traces(tmp_path)), 0)
    rate = sum(s.generated_tokens for s in sim.steps) / sum(s.engine_busy_s for s in sim.steps)
    assert rate == pytest.approx(900.0, rel=0.05) and e.streaming_slowdown_by_mode["async"] > 1.0


def test_a_bench_trace_is_every_group_in_stream_order_and_outlives_the_runs(tmp_path) -> None:
    """``bench_traces`` reads each run's groups in train-stream order (samples by index), keeps them beside
    bench.json, reads that file once the runs are gone, and names the run when it has neither."""
    import shutil

    from reflow.bench.sim_calibrate import TRACES, bench_traces
    from reflow.infra.run import load_record
    from reflow.storage.delta_store import DeltaTrajectoryStore

    root = _synthetic_bench(tmp_path)
    traces = bench_traces(root)
    assert set(traces) == {"sync:0", "one_step_off:0", "async:0"} and (root / TRACES).is_file()
    record = load_record(str(root / "runs" / "sync"))
    cols = DeltaTrajectoryStore(record.store_root).read_trajectories(run_id="sync").to_pydict()
    by_row = {(gid, k): n for gid, k, n in zip(cols["group_id"], cols["sample_index"], cols["response_length"])}
    sync = traces["sync:0"]
    assert sync.ordered and len(sync.lengths) == 8 * 4
    for position in (0, 5, 31):  # group g<position> of the stream, step position // 4
        gid = f"sync/g{position}/p{position // 4}-{position % 4}"
        assert sync.lengths[position] == [by_row[(gid, k)] for k in range(4)]
    shutil.rmtree(root / "runs")
    assert bench_traces(root) == traces
    (root / TRACES).unlink()
    with pytest.raises(ValueError, match=r"run sync seed 0 is gone .* no traces.json.gz"):
        bench_traces(root)


def test_a_trace_holds_the_groups_a_streaming_run_gave_up_at_their_positions(tmp_path) -> None:
    """A group the async run gave up in flight comes in its trace at its stream position: the samples that
    finished at their lengths (late ones too), each one it never finished at the response limit, rewards 0; the
    profile's draws of the run hold only the groups it wrote."""
    from reflow.bench.sim_calibrate import bench_traces, calibrate
    from reflow.infra.run import load_config_of, read_given_up

    root = _synthetic_bench(tmp_path, given_up={5: [40, 12], 17: [9]})
    run_dir = root / "runs" / "async"
    assert read_given_up(run_dir) == {5: [40, 12], 17: [9]}
    with open(run_dir / "given_up.jsonl", "a") as out:
        out.write('{"position": 9, "len')  # a torn last line: the run was killed while appending it
    assert read_given_up(run_dir) == {5: [40, 12], 17: [9]}
    limit = load_config_of(str(run_dir)).rollout.max_response_tokens
    trace = bench_traces(root)["async:0"]
    assert len(trace.lengths) == 32 and trace.lengths[5] == [40, 12, limit, limit]
    assert trace.lengths[17] == [9, limit, limit, limit] and trace.rewards[5] == trace.rewards[17] == [0.0] * 4
    assert all(max(g) < 60 for i, g in enumerate(trace.lengths) if i not in (5, 17))  # the written groups
    assert len(calibrate(root).lengths.by_run["async:0"].lengths) == 30


def test_validate_names_a_run_that_gave_groups_up_without_recording_them(tmp_path) -> None:
    """A streaming run that gave groups up in flight and has no ``given_up.jsonl`` (kept before it was) is named:
    its trace is the written groups only. A run that recorded them, or gave none up, is not."""
    import json as _json

    from reflow.bench.sim_calibrate import unrecorded_given_up

    root = _synthetic_bench(tmp_path / "old")
    assert unrecorded_given_up(root) == []  # no run gave a group up
    steps = root / "runs" / "async" / "steps.jsonl"
    lines = [_json.loads(line) for line in steps.read_text().splitlines()]
    lines[-1]["metrics"]["groups_abandoned"] = 3.0
    steps.write_text("".join(_json.dumps(line) + "\n" for line in lines))
    (warning,) = unrecorded_given_up(root)
    assert warning.startswith("run async seed 0 gave up 3 groups in flight") and "given_up.jsonl" in warning
    recorded = _synthetic_bench(tmp_path / "new", given_up={5: [40]})
    steps = recorded / "runs" / "async" / "steps.jsonl"
    lines = [_json.loads(line) for line in steps.read_text().splitlines()]
    lines[-1]["metrics"]["groups_abandoned"] = 1.0
    steps.write_text("".join(_json.dumps(line) + "\n" for line in lines))
    assert unrecorded_given_up(recorded) == []


def test_a_simulated_run_replays_its_trace_group_by_group() -> None:
    """With an ordered trace, simulated group g is the trace's g-th group (cycling), samples in order: a sync
    run of two steps of two groups generates exactly the first four groups' tokens, cut at the response limit."""
    from reflow.bench.sim_profile import MeasuredGroups

    lengths = [[3, 5], [7, 400], [2, 2], [9, 1], [50, 50]]
    trace = MeasuredGroups(lengths=lengths, rewards=[[1, 0], [0, 0], [1, 1], [0, 1], [1, 0]], ordered=True)
    rng = np.random.default_rng(0)
    assert [trace.draw(rng, 2, g)[0].tolist() for g in (0, 1, 5, 6)] == [[3, 5], [7, 400], [3, 5], [7, 400]]
    assert trace.draw(rng, 3, 3)[0].tolist() == [9, 1, 9] and trace.draw(rng, 2, 4)[1].tolist() == [1.0, 0.0]
    prof = profile([[1, 1]])
    prof = prof.model_copy(update={"lengths": prof.lengths.model_copy(update={"by_run": {"sync:0": trace}})})
    sets = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "run.total_steps=2",
            "rollout.max_response_tokens=320"]
    sim = simulate(mode_config(None, sets, "sync", 0, equal_steps=False), prof, 0)
    assert [s.generated_tokens for s in sim.steps] == [3 + 5 + 7 + 320, 2 + 2 + 9 + 1]


def test_calibration_without_a_sync_run_says_so(tmp_path) -> None:
    import json as _json

    from reflow.bench.sim_calibrate import calibrate

    root = _synthetic_bench(tmp_path)
    data = _json.loads((root / "bench.json").read_text())
    data["runs"] = [r for r in data["runs"] if r["mode"] != "sync"]
    (root / "bench.json").write_text(_json.dumps(data))
    with pytest.raises(ValueError, match="needs a sync run"):
        calibrate(root)


# validation against a real bench


BENCH_FIXTURE = PACKAGE / "tests" / "fixtures" / "sim"


@pytest.mark.slow
def test_the_cpu_profile_reproduces_the_stored_bench(tmp_path, capsys) -> None:
    """``reflow simulate --validate`` on the stored bench (configs/bench.toml, seeds 0 and 1, 2026-12-07 at
    e39b2ae, each run replaying its stored trace: the groups it wrote and the groups it gave up in flight) with the
    CPU profile calibrated on its seed-0 runs (docs/simulation.md "Validation").

    The bounds are what the model reaches, kept so a change that makes it worse fails: 34 of the 36 figures are
    within the issue's 15%, every one of the held-out seed 1; on seed 0, one_step_off's generated tokens/s is 15.2%
    over and reflow's trainer idle 20% (2.3 points) under. So: every figure within 16%, or a share of the step
    within 2.5 points.
    """
    code = main(["simulate", "--validate", str(BENCH_FIXTURE), "--profile", str(DEFAULT_PROFILE),
                 "--output", str(tmp_path / "v")])
    print(capsys.readouterr().out)
    import json

    validation = json.loads((tmp_path / "v" / "sim.json").read_text())["validation"]
    assert validation["checked"] == 2 * (4 * 4 + 2)  # two seeds; four modes, four figures each, two bubbles
    assert code == (0 if validation["passed"] else 1)
    within = [r for r in validation["rows"] if r["error"] <= 0.15]
    assert len(within) >= 34
    for r in validation["rows"]:
        label = f"{r['mode']} s{r['seed']} {r['figure']}: {r['error']:.0%}"
        if r["points"] is not None:
            assert r["error"] <= 0.16 or r["points"] <= 0.025, label
        else:
            assert r["error"] <= 0.16, label


@pytest.mark.parametrize("bottleneck", ["trainer", "engines"])
def test_the_elastic_pool_moves_its_worker_to_the_slow_stage_and_gains_samples(bottleneck: str) -> None:
    """Two engines and one flex worker under the real ``control.roles`` scheduler. Trainer-bound, the worker
    starts generating, moves to training and computes shares of steps; engine-bound, it starts training and
    moves to generation. Either way it makes new samples faster than a worker held in its first role."""
    if bottleneck == "trainer":
        prof, first = profile([[5, 6, 5, 4]], [[1, 0, 1, 0]], base=0.002, token_s=0.004, trainer_base=0.02), "generate"
    else:
        prof, first = profile([[60, 80, 70, 90]], [[1, 0, 1, 0]], base=0.01, token_s=1e-5), "train"
    sets = {"resources.engines": "2", "resources.flex_workers": "1", "resources.flex_cpus": "0",
            "pool.window_s": "0.5", "pool.switch_estimate_s": "0", "pool.initial_role": f'"{first}"',
            "run.total_steps": "40"}
    pooled = simulate(small("async", **sets, **{"pool.dwell_s": "1"}), prof, 0)
    held = simulate(small("async", **sets, **{"pool.dwell_s": "80000"}), prof, 0)
    assert held.switches == 0 and pooled.switches >= 1
    if bottleneck == "trainer":
        assert pooled.helper_steps > 0 and held.helper_steps == 0
    else:  # held in training, the worker computed shares all along; moved, it stopped
        assert held.helper_steps == len(held.steps) > pooled.helper_steps
    assert summarise(pooled).new_samples_per_s > 1.1 * summarise(held).new_samples_per_s


def test_flex_workers_outside_the_streaming_modes_are_refused() -> None:
    prof = profile()
    with pytest.raises(ValueError, match="streaming modes only"):
        simulate(small("sync", **{"resources.flex_workers": "1"}), prof, 0)


def test_the_scheduler_reads_the_engines_wait_as_the_real_feeder_reports_it(monkeypatch) -> None:
    """``Drained.busy_s`` is the pool's mean (the real feeder's contract), so the engine wait the stage-speed
    scheduler measures over its windows agrees with the run's generator idle; a sum over the eight engines
    read it as none at all (the scheduler then kept a trainer-bound pool of 32 GPUs from moving)."""
    import reflow.bench.simulate as sim

    loops = []

    class Spy(sim.StreamingLoops):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            loops.append(self)

    monkeypatch.setattr(sim, "StreamingLoops", Spy)
    prof = profile([[30, 40, 35, 45]], [[1, 0, 1, 0]], base=0.01, token_s=0.001, trainer_base=0.02)
    run = simulate(small("async", **{"resources.engines": "6", "resources.flex_workers": "2",
                                     "resources.flex_cpus": "0", "pool.window_s": "0.5",
                                     "pool.dwell_s": "80000", "run.total_steps": "40"}), prof, 0)
    waits = [d.rates.generator_wait for d in loops[-1].pool.scheduler.decisions]
    idle = summarise(run).generator_idle
    assert 0.3 < idle < 0.9 and len(waits) >= 5  # engines busy a third of the time: eight of them sum past 1
    assert statistics.fmean(waits) == pytest.approx(idle, abs=0.1), (waits, idle)


@pytest.mark.parametrize("mode", ["async", "reflow"])
def test_a_long_simulation_holds_the_window_not_the_run(monkeypatch, mode: str) -> None:
    """The modelled buffer keeps the rows and loss tokens of the selection window only, and the pool forgets a
    group once it is written or abandoned: what a simulation holds stops growing with its steps (1,000 steps
    at 128 GPUs held 10.8 GiB when every row stayed). The figures are those of a buffer that kept everything:
    the window is all a selection reads."""
    import reflow.bench.simulate as sim

    buffers, pools = [], []

    class Buffer(sim.SimBuffer):
        def __init__(self) -> None:
            super().__init__()
            buffers.append(self)

    class Pool(sim.EnginePool):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(sim, "SimBuffer", Buffer)
    monkeypatch.setattr(sim, "EnginePool", Pool)
    prof = profile([[3, 9, 4, 30], [12, 12, 2, 5]], [[1, 0, 1, 0], [1, 1, 0, 1]], base=0.005, token_s=0.0005)
    run = simulate(small(mode, **{"run.total_steps": "60"}), prof, 0)
    buffer, pool = buffers[-1], pools[-1]
    window, batch = 3 + 1, 8 * 4  # buffer.max_staleness_versions + 1 versions of batches of 8 groups of 4
    groups = sum(s.new_samples for s in run.steps) // 4
    assert groups >= 60 * 8 * (0.5 if mode == "reflow" else 1)
    assert buffer.window.floor == len(run.steps) - 1 - 3  # the last selection's: the floor rose with the run
    assert 0 < len(buffer.tokens) <= 3 * window * batch < groups * 4
    assert min(v for v in buffer._ids) >= buffer.window.floor
    buffer.select(sim.RUN, buffer.window.floor, "SELECT 1")  # the appends since the last selection reach the window
    held = buffer.window.tables()["trajectories"].column("policy_version").to_pylist()
    assert held and min(held) >= buffer.window.floor and len(held) == len(buffer.tokens)
    assert len(pool.rewards) == len(pool.lengths_of) == len(pool.varied) <= 64 // 4 + 2 * 8  # the groups in flight
    with pytest.raises(ValueError, match="below the window's floor"):
        buffer.select(sim.RUN, buffer.window.floor - 1, "SELECT 1")


def test_the_engine_check_compares_the_modelled_step_with_bench_engine(tmp_path, capsys) -> None:
    """``reflow simulate --check-engine``: modelled tokens/s ``c / step_s`` at each measured concurrency, the
    context a length-biased half response (lengths 2 and 6: prompt 4 + E[L^2] / (2 E[L]) = 4 + 20 / 8 = 6.5 tokens)."""
    import json as _json

    from reflow.bench.sim_calibrate import engine_check

    prof = profile([[2, 6]], base=0.004, per_seq=0.001)
    prof = prof.model_copy(update={"engine": prof.engine.model_copy(update={"per_context_token_s": 1e-5})})
    step = lambda c: 0.004 + 0.001 * c + 1e-5 * 6.5 * c  # noqa: E731
    figures = {"points": [{"concurrency": c, "tokens_per_s": c / step(c) * f, "step_ms_median": 1000 * step(c)}
                          for c, f in ((8, 1.0), (64, 0.5))]}
    rows = engine_check(prof, figures)
    assert [r["modelled_tokens_per_s"] for r in rows] == pytest.approx([8 / step(8), 64 / step(64)])
    assert [r["error"] for r in rows] == pytest.approx([0.0, 1.0])
    (tmp_path / "bench_engine.json").write_text(_json.dumps(figures))
    path = tmp_path / "p.json"
    from reflow.bench.sim_profile import save_profile

    save_profile(prof, path)
    assert main(["simulate", "--check-engine", str(tmp_path), "--profile", str(path), "--output",
                 str(tmp_path / "out")]) == 0
    assert "      64" in capsys.readouterr().out and (tmp_path / "out" / "engine_check.json").is_file()
    assert main(["simulate", "--check-engine", str(tmp_path / "none"), "--output", str(tmp_path / "o2")]) == 2
    assert "run reflow bench-engine --output" in capsys.readouterr().err


def test_a_stored_bench_is_simulated_with_the_config_its_runs_read() -> None:
    """bench.json keeps the text of the config file its runs read; the file may have changed since (as when
    async's staleness bound went from 8 to 4), and a simulation of the bench runs with the text it kept."""
    import json

    meta = json.loads((BENCH_FIXTURE / "bench.json").read_text())["meta"]
    config = config_path(meta["config"])
    kept = meta["config_text"].replace("async = 4,", "async = 8,")
    assert kept != meta["config_text"], "the stored bench.json no longer sets async's staleness bound to 4"
    then = mode_config(config, meta["overrides"], "async", 0, False, kept)
    now = mode_config(config, meta["overrides"], "async", 0, False)
    assert (then.buffer.max_staleness_versions, now.buffer.max_staleness_versions) == (8, 4)
    assert then.rollout == now.rollout and then.run.total_steps == now.run.total_steps


def test_the_control_plane_cpu_is_the_loops_threads_less_the_models() -> None:
    """Streaming modes report the real loops' CPU per step (the simulation threads' CPU less the engine and trainer
    models'); rounds run no loop and report none."""
    prof = profile([[5, 6, 5, 4]], [[1, 0, 1, 0]])
    streamed = simulate(small("async"), prof, 0)
    assert 0 < streamed.model_cpu_s < streamed.cpu_s
    per_step = summarise(streamed).control_cpu_s_per_step
    assert per_step is not None and 0 < per_step * len(streamed.steps) < streamed.cpu_s
    assert summarise(simulate(small("sync"), prof, 0)).control_cpu_s_per_step is None
