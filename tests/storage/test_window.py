"""The selection window answers as the whole tables do, fed by the store's own commits; a new store reads it afresh."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.memory_store import InMemoryTrajectoryStore
from reflow.storage.replay import ReplayPolicy, select_batch, select_batch_sql
from reflow.storage.schema import Trajectory

RUN = "run"


def _group(name: str, version: int, size: int, rng: random.Random, run: str = RUN) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{name}/{k}", run_id=run, prompt_id=name, group_id=name, sample_index=k,
                       env="arith", rollout_step=version, policy_version=version, prompt_tokens=[1, 2],
                       response_tokens=[3], behaviour_logprobs=[-0.5], token_versions=[version], loss_mask=[1],
                       reward=float(rng.random() < 0.5), correct=False, finish_reason="stop", response_length=1)
            for k in range(size)]


def _whole_tables(store: DeltaTrajectoryStore, tv: int, policy: ReplayPolicy) -> list[tuple]:
    """The same SQL over the whole Delta tables (``query`` reads every file), as (id, group, uses, part)."""
    cols = store.query(select_batch_sql(RUN, tv, 4, policy, samples_per_prompt=3)).to_pydict()
    return list(zip(cols["trajectory_id"], cols["group_id"], cols["uses"], cols["part"]))


def _window(store, tv: int, policy: ReplayPolicy) -> list[tuple]:
    floor = tv - policy.max_staleness_versions
    cols = store.select(RUN, floor, select_batch_sql(RUN, tv, 4, policy, samples_per_prompt=3)).to_pydict()
    return list(zip(cols["trajectory_id"], cols["group_id"], cols["uses"], cols["part"]))


def _window_runs(store: DeltaTrajectoryStore) -> set[str]:
    """The run ids of the rows in RUN's window."""
    tables = store._windows[RUN].tables()
    return {run for name in ("trajectories", "usage") for run in tables[name]["run_id"].to_pylist()}


def _count_reads(store: DeltaTrajectoryStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    original = store._window_rows

    def counted(run_id: str, floor: int):
        reads.append(floor)
        return original(run_id, floor)

    monkeypatch.setattr(store, "_window_rows", counted)
    return reads


@pytest.mark.parametrize("order", ["newest", "advantage", "signal"])
def test_the_window_fed_by_commits_selects_what_the_whole_tables_give(tmp_path: Path, order: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(order)
    store = DeltaTrajectoryStore(tmp_path)
    reads = _count_reads(store, monkeypatch)
    policy = ReplayPolicy(max_staleness_versions=2, replay_ratio=0.5, max_reuse=2, replay_order=order)
    selected, replayed = 0, 0
    for tv in range(12):
        groups = [_group(f"g{tv}-{i}", tv, rng.choice([2, 3]), rng) for i in range(3)]  # size 2: never admissible
        groups.append(_group(f"other{tv}", tv, 3, rng, run="other"))  # another run's rows stay out
        store.append_trajectories([r for g in groups for r in g], app_id="f", txn_version=tv)
        got = _window(store, tv, policy)
        if tv > 0:  # (no usage table before the first step: the whole-tables SQL needs one)
            assert got == _whole_tables(store, tv, policy), tv
        assert all(g.startswith("g") for _, g, _, _ in got)
        assert _window_runs(store) == {RUN}  # the other run's rows, fed by the same commits, stay out
        sel = select_batch(store, RUN, tv, 4, policy, samples_per_prompt=3)
        assert [(t, g, u) for t, g, u, _ in got] == list(zip(sel.trajectory_ids, sel.group_ids, sel.reuse_counts))
        store.append_usage(sel.usage_rows(RUN, tv, tv), app_id="t", txn_version=tv)
        selected += len(sel.trajectory_ids)
        replayed += sel.kinds.count("replay")
    assert selected > 0 and replayed > 0
    assert reads == [-2], reads  # read from the tables once; every other selection ran on what commits fed it


def test_a_new_store_or_a_lower_floor_reads_the_window_and_other_runs_never_enter_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    store, other = DeltaTrajectoryStore(tmp_path), DeltaTrajectoryStore(tmp_path)
    reads = _count_reads(store, monkeypatch)
    policy = ReplayPolicy(max_staleness_versions=1, replay_ratio=0.5, max_reuse=2)
    for tv in range(4):
        store.append_trajectories(_group(f"a{tv}", tv, 3, rng), app_id="f", txn_version=tv)
    other.append_usage(select_batch(other, RUN, 0, 1, policy).usage_rows(RUN, 0, 0), app_id="t", txn_version=0)
    assert _window(store, 3, policy) == _whole_tables(store, 3, policy)
    # another run writing to the same tables (a shared root): its rows never enter this run's window, whether
    # through another store or through this one (whose commits feed its windows)
    other.append_trajectories(_group("b", 3, 3, rng, run="another"), app_id="g", txn_version=0)
    store.append_trajectories(_group("b2", 3, 3, rng, run="another"), app_id="g2", txn_version=0)
    assert _window(store, 3, policy) == _whole_tables(store, 3, policy)
    assert _window_runs(store) == {RUN}
    assert reads == [2]
    # a resumed run is a new process, so a new store: it reads the window, with what the old one wrote
    store.append_trajectories(_group("c", 3, 3, rng), app_id="f", txn_version=4)
    assert "c" in {g for _, g, _, _ in _window(DeltaTrajectoryStore(tmp_path), 3, policy)}
    assert _window(store, 1, policy) == _whole_tables(store, 1, policy)  # older rows than the window holds
    assert reads == [2, 0]


def test_the_in_memory_store_selects_as_the_delta_store_does(tmp_path: Path) -> None:
    rng = random.Random(1)
    delta, memory = DeltaTrajectoryStore(tmp_path), InMemoryTrajectoryStore()
    policy = ReplayPolicy(max_staleness_versions=3, replay_ratio=0.5, max_reuse=3, replay_order="advantage")
    for tv in range(6):
        rows = [r for i in range(2) for r in _group(f"g{tv}-{i}", tv, 3, rng)]
        for store in (delta, memory):
            store.append_trajectories(rows, app_id="f", txn_version=tv)
        sel = select_batch(delta, RUN, tv, 4, policy, samples_per_prompt=3)
        assert select_batch(memory, RUN, tv, 4, policy, samples_per_prompt=3) == sel
        for store in (delta, memory):
            store.append_usage(sel.usage_rows(RUN, tv, tv), app_id="t", txn_version=tv)
