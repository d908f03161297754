from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.queries import recorded_batch, recorded_selection, trained_groups
from reflow.storage.replay import ReplayPolicy, ReplaySelection, replay_weight, select_batch, select_batch_sql
from reflow.storage.schema import Trajectory, Usage

RUN = "run"


def _traj(group: str, k: int, version: int, reward: float = 0.0, run: str = RUN) -> Trajectory:
    return Trajectory(trajectory_id=f"{group}/{k}", run_id=run, prompt_id=group, group_id=group, sample_index=k,
                      env="arith", rollout_step=version, policy_version=version, prompt_tokens=[1, 2],
                      response_tokens=[3], behaviour_logprobs=[-0.5], token_versions=[version], loss_mask=[1],
                      reward=reward, correct=reward > 0, finish_reason="stop", response_length=1)


def _group(name: str, version: int, size: int, rewards: list[float] | None = None) -> list[Trajectory]:
    rewards = rewards or [0.0] * size
    return [_traj(name, k, version, rewards[k]) for k in range(size)]


def _weight(reuse: int, staleness: int) -> float:
    return 0.5**reuse * 0.75**staleness


@dataclass
class Model:
    """What the store should hold, kept in Python to check selections against."""

    rows: dict[str, Trajectory] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    uses: Counter[str] = field(default_factory=Counter)

    def add(self, records: list[Trajectory]) -> None:
        for r in records:
            self.rows[r.trajectory_id] = r
            self.groups[r.group_id].append(r.trajectory_id)

    def admissible(self, group: str, tv: int, policy: ReplayPolicy, size: int) -> bool:
        ids = self.groups[group]
        versions = [self.rows[t].policy_version for t in ids]
        return (len(ids) == size and all(0 <= tv - v <= policy.max_staleness_versions for v in versions)
                and max(self.uses[t] for t in ids) < policy.max_reuse)

    def group_uses(self, group: str) -> int:
        return max(self.uses[t] for t in self.groups[group])


def _check(sel: ReplaySelection, model: Model, tv: int, policy: ReplayPolicy, needed: int, size: int) -> None:
    """Every rule of the buffer, checked against the Python model."""
    n = len(sel.trajectory_ids)
    assert len(set(sel.trajectory_ids)) == n
    assert all(len(x) == n for x in (sel.loss_weights, sel.policy_versions, sel.reuse_counts, sel.kinds,
                                     sel.group_ids))
    # staleness bound, per trajectory
    assert all(0 <= s <= policy.max_staleness_versions for s in sel.staleness)
    # reuse: counts match the log; no trajectory goes past max_reuse counting this step
    for tid, reuse in zip(sel.trajectory_ids, sel.reuse_counts):
        assert reuse == model.uses[tid] and reuse + 1 <= policy.max_reuse
    # replay share of the batch
    replayed = sum(k == "replay" for k in sel.kinds)
    assert replayed <= policy.replay_ratio * n + 1e-9
    # kinds and weights
    for tid, kind, v, reuse, w in zip(sel.trajectory_ids, sel.kinds, sel.policy_versions, sel.reuse_counts,
                                      sel.loss_weights):
        assert v == model.rows[tid].policy_version
        assert kind == ("replay" if reuse else "fresh" if v == tv else "stale")
        assert w == pytest.approx(_weight(reuse, tv - v))
    # "signal" never replays a group whose rewards are all equal (no gradient)
    if policy.replay_order == "signal":
        for g in {g for g, kind in zip(sel.group_ids, sel.kinds) if kind == "replay"}:
            assert len({model.rows[t].reward for t in model.groups[g]}) > 1, g
    # whole groups, contiguous in the lists, at most `needed` of them
    chosen = list(dict.fromkeys(sel.group_ids))
    assert len(chosen) <= needed
    for g in chosen:
        picked = [t for t, gg in zip(sel.trajectory_ids, sel.group_ids) if gg == g]
        assert sorted(picked) == sorted(model.groups[g]) and len(picked) == size
    assert [g for i, g in enumerate(sel.group_ids) if i == 0 or sel.group_ids[i - 1] != g] == chosen
    # fresh before replay, and unused groups taken oldest first
    kinds = ["replay" if k == "replay" else "unused" for k in sel.kinds]
    assert kinds == sorted(kinds, key=lambda k: k == "replay")
    unused_left = [g for g in model.groups if g not in chosen and model.admissible(g, tv, policy, size)
                   and model.group_uses(g) == 0]
    chosen_unused = [g for g in chosen if model.group_uses(g) == 0]
    if unused_left:
        assert len(chosen_unused) == needed and replayed == 0
        oldest = lambda g: (min(model.rows[t].policy_version for t in model.groups[g]), g)  # noqa: E731
        assert max(map(oldest, chosen_unused), default=(-1, "")) < min(map(oldest, unused_left))


def _random_schedule(rng: random.Random, root: Path) -> int:
    """Run one random schedule of appends, selections, usage appends and version advances; return steps."""
    store = DeltaTrajectoryStore(root)
    # a reader with its own kept tables (selections run on the writer's store: its window is fed by its commits)
    source = DeltaTrajectoryStore(root) if rng.random() < 0.5 else store
    policy = ReplayPolicy(max_staleness_versions=rng.choice([0, 1, 2, 3, 3]),
                          replay_ratio=rng.choice([0.0, 0.3, 0.5, 0.75, 1.0, 1.0]),
                          max_reuse=rng.choice([1, 2, 3, 3]),
                          replay_order=rng.choice(["newest", "advantage", "signal"]))
    size, model, tv, step, appends = rng.randint(2, 3), Model(), 0, 0, 0
    for _ in range(rng.randint(5, 9)):
        records: list[Trajectory] = []
        for g in range(rng.choice([0, 1, 1, 2, 3])):
            name = f"v{tv}/a{appends}/g{g}"
            # from one version past the window to one version past the trainer (a feeder ahead of the
            # trainer, as when the selector works for the version after the step under way)
            version = rng.randint(max(0, tv - policy.max_staleness_versions - 1), tv + 1)
            group = _group(name, version, size, [float(rng.random() < 0.5) for _ in range(size)])
            shape = rng.random()
            if shape < 0.1:  # a group still being written: not admissible yet
                group = group[:-1]
            elif shape < 0.2 and version > 0:  # a partial rollout: one sample started a version earlier
                group[0] = _traj(name, 0, version - 1, group[0].reward)
            records += group
        if records:
            store.append_trajectories(records, app_id="feeder", txn_version=appends)
            model.add(records)
            appends += 1
        needed = rng.randint(1, 5)
        sel = select_batch(store, RUN, tv, needed, policy, _weight, samples_per_prompt=size)
        _check(sel, model, tv, policy, needed, size)
        if sel.trajectory_ids:
            store.append_usage(sel.usage_rows(RUN, step, sel.trainer_version), app_id="trainer", txn_version=step)
            model.uses.update(sel.trajectory_ids)
            expected = dict(zip(sel.trajectory_ids, sel.loss_weights))
            assert recorded_batch(source, RUN, step) == pytest.approx(expected)
            step += 1
        tv += rng.choice([0, 0, 1, 1, 2])
    return step


def test_random_schedules_never_break_a_rule(tmp_path: Path) -> None:
    rng = random.Random(20250601)
    steps = [_random_schedule(rng, tmp_path / f"s{i}") for i in range(30)]
    assert sum(steps) > 30  # the schedules did train (and replay) rather than only wait


def test_empty_store_and_store_without_usage(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    policy = ReplayPolicy(2, 0.5, 2)
    assert select_batch(store, RUN, 0, 4, policy).trajectory_ids == []
    store.append_trajectories(_group("a", 0, 2) + _group("b", 1, 2), app_id="f", txn_version=0)
    sel = select_batch(store, RUN, 1, 4, policy)  # no usage table yet
    assert sel.group_ids == ["a", "a", "b", "b"] and sel.kinds == ["stale", "stale", "fresh", "fresh"]
    assert sel.loss_weights == [1.0] * 4 and sel.replay_share == 0.0


def test_replay_fills_behind_fresh_up_to_the_ratio(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    store.append_trajectories([r for g in "abcd" for r in _group(g, 0, 2)], app_id="f", txn_version=0)
    used = [Usage(RUN, f"{g}/{k}", 0, 0, 1.0, 0) for g in "abcd" for k in range(2)]
    store.append_usage(used, app_id="t", txn_version=0)
    store.append_trajectories(_group("e", 1, 2) + _group("f", 1, 2), app_id="f", txn_version=1)
    # 2 fresh groups (4 samples); ratio 0.5 allows 4 replayed samples (2 groups), newest-first ties by id
    sel = select_batch(store, RUN, 1, 8, ReplayPolicy(1, 0.5, 2, "newest"))
    assert list(dict.fromkeys(sel.group_ids)) == ["e", "f", "a", "b"]
    assert sel.kinds == ["fresh"] * 4 + ["replay"] * 4 and sel.reuse_counts == [0] * 4 + [1] * 4
    assert sel.replay_share == 0.5
    # ratio 0.4: 4 fresh samples allow 2 replayed (2/6 <= .4) but not 4 (4/8 > .4)
    assert list(dict.fromkeys(select_batch(store, RUN, 1, 8, ReplayPolicy(1, 0.4, 2)).group_ids)) == ["e", "f", "a"]
    # nothing fresh: no replay either (the share is of the batch returned)
    store.append_usage([Usage(RUN, f"{g}/{k}", 1, 1, 1.0, 0) for g in "ef" for k in range(2)],
                       app_id="t", txn_version=1)
    assert select_batch(store, RUN, 1, 8, ReplayPolicy(1, 0.5, 3)).trajectory_ids == []
    assert len(select_batch(store, RUN, 1, 8, ReplayPolicy(1, 1.0, 3)).trajectory_ids) == 12
    # max_reuse 1 never replays; the bound drops version 0 at trainer version 2 with staleness 1
    assert select_batch(store, RUN, 1, 8, ReplayPolicy(1, 1.0, 1)).trajectory_ids == []
    assert set(select_batch(store, RUN, 2, 8, ReplayPolicy(1, 1.0, 3)).group_ids) == {"e", "f"}


def test_trained_groups_counts_distinct_groups_before_a_step(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    assert trained_groups(store, RUN, 5) == 0  # no tables yet
    store.append_trajectories([r for g in "abc" for r in _group(g, 0, 2)], app_id="f", txn_version=0)
    assert trained_groups(store, RUN, 5) == 0  # no usage log yet
    # step 0 trains a and b; step 1 replays a and trains c; another run's rows never count
    store.append_usage([Usage(RUN, f"{g}/{k}", 0, 0, 1.0, 0) for g in "ab" for k in range(2)] +
                       [Usage(RUN, f"{g}/{k}", 1, 1, 0.5, 0) for g in "ac" for k in range(2)] +
                       [Usage("other", "c/0", 0, 0, 1.0, 0)], app_id="t", txn_version=0)
    assert [trained_groups(store, RUN, s) for s in (0, 1, 2, 9)] == [0, 2, 3, 3]
    assert trained_groups(store, "other", 1) == 1


def test_recorded_selection_rebuilds_what_select_batch_returned(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    store.append_trajectories([r for g in "ab" for r in _group(g, 0, 2)], app_id="f", txn_version=0)
    assert recorded_selection(store, RUN, 0) is None  # no usage log
    policy = ReplayPolicy(2, 0.5, 2, "newest")
    logged: dict[int, ReplaySelection] = {}
    for step, tv in enumerate((0, 1)):
        if step == 1:  # c is fresh at version 1, d stale (version 0, never used), a and b replayed
            store.append_trajectories(_group("c", 1, 2) + _group("d", 0, 2), app_id="f", txn_version=1)
        sel = select_batch(store, RUN, tv, 4, policy, _weight)
        store.append_usage([Usage(RUN, t, step, tv, w, tv - v) for t, w, v in
                            zip(sel.trajectory_ids, sel.loss_weights, sel.policy_versions)],
                           app_id="t", txn_version=step)
        logged[step] = sel
    assert set(logged[1].kinds) == {"fresh", "stale", "replay"}
    for step, sel in logged.items():
        rebuilt = recorded_selection(store, RUN, step)
        assert rebuilt is not None
        order = sorted(range(len(sel.trajectory_ids)), key=lambda i: sel.trajectory_ids[i])
        for field_name in ("trajectory_ids", "loss_weights", "policy_versions", "group_ids", "reuse_counts", "kinds"):
            assert getattr(rebuilt, field_name) == [getattr(sel, field_name)[i] for i in order], field_name
        assert rebuilt.trainer_version == sel.trainer_version
    assert recorded_selection(store, RUN, 2) is None and recorded_selection(store, "other", 0) is None


def test_replay_order_by_advantage(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    # reward variance: flat 0, half 0.25, skew (1,0,0,0): 0.1875; newer groups first among ties
    groups = {"flat": [1.0, 1.0, 1.0, 1.0], "half": [1.0, 0.0, 1.0, 0.0], "skew": [1.0, 0.0, 0.0, 0.0]}
    records = [r for name, rewards in groups.items() for r in _group(name, 0, 4, rewards)]
    store.append_trajectories(records + _group("half_new", 1, 4, [0.0, 1.0, 1.0, 0.0]), app_id="f", txn_version=0)
    store.append_usage([Usage(RUN, r.trajectory_id, 0, 1, 1.0, 0) for r in records] +
                       [Usage(RUN, f"half_new/{k}", 0, 1, 1.0, 0) for k in range(4)], app_id="t", txn_version=0)
    by_advantage = select_batch(store, RUN, 1, 4, ReplayPolicy(1, 1.0, 2, "advantage"))
    assert list(dict.fromkeys(by_advantage.group_ids)) == ["half_new", "half", "skew", "flat"]
    newest = select_batch(store, RUN, 1, 4, ReplayPolicy(1, 1.0, 2, "newest"))
    assert list(dict.fromkeys(newest.group_ids)) == ["half_new", "flat", "half", "skew"]


def test_the_spread_is_the_reward_variance(tmp_path: Path) -> None:
    # rewards other than 0/1, where the variance and the mean |centred reward| disagree:
    #   "skew"  (1, 0, 0, 0):         mean 0.25, variance 0.1875, mean |r - mean| 0.375
    #   "close" (0.9, 0.1, 0.9, 0.1): mean 0.5,  variance 0.16,   mean |r - mean| 0.4
    store = DeltaTrajectoryStore(tmp_path)
    groups = {"skew": [1.0, 0.0, 0.0, 0.0], "close": [0.9, 0.1, 0.9, 0.1]}
    records = [r for name, rewards in groups.items() for r in _group(name, 0, 4, rewards)]
    store.append_trajectories(records, app_id="f", txn_version=0)
    store.append_usage([Usage(RUN, r.trajectory_id, 0, 1, 1.0, 0) for r in records], app_id="t", txn_version=0)
    by_advantage = select_batch(store, RUN, 1, 2, ReplayPolicy(1, 1.0, 2, "advantage"))
    assert list(dict.fromkeys(by_advantage.group_ids)) == ["skew", "close"]


def test_replay_order_by_signal_weighs_the_spread_by_reuse_and_age(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    # at trainer version 2 (decays 0.5 per use, 0.9 per version), spread x weight:
    #   "old_wide"   v0, used once:  0.25   * 0.5    * 0.81 = 0.10125
    #   "new_narrow" v2, used once:  0.1875 * 0.5    * 1    = 0.09375
    #   "reused"     v2, used twice: 0.25   * 0.25   * 1    = 0.0625
    #   "flat"       v2, used once:  0 -> never replayed
    groups = {"old_wide": (0, [1.0, 0.0, 1.0, 0.0], 1), "new_narrow": (2, [1.0, 0.0, 0.0, 0.0], 1),
              "reused": (2, [0.0, 1.0, 0.0, 1.0], 2), "flat": (2, [1.0, 1.0, 1.0, 1.0], 1)}
    records = {name: _group(name, version, 4, rewards) for name, (version, rewards, _) in groups.items()}
    store.append_trajectories([r for group in records.values() for r in group], app_id="f", txn_version=0)
    usage = [Usage(RUN, r.trajectory_id, step, 2, 1.0, 0)
             for name, (_, _, uses) in groups.items() for step in range(uses) for r in records[name]]
    store.append_usage(usage, app_id="t", txn_version=0)
    signal = select_batch(store, RUN, 2, 4, ReplayPolicy(2, 1.0, 3, "signal"))
    assert list(dict.fromkeys(signal.group_ids)) == ["old_wide", "new_narrow", "reused"]
    # the advantage order takes the spread alone (newer first among ties) and replays the flat group last
    advantage = select_batch(store, RUN, 2, 4, ReplayPolicy(2, 1.0, 3, "advantage"))
    assert list(dict.fromkeys(advantage.group_ids)) == ["reused", "old_wide", "new_narrow", "flat"]
    # a steeper age decay (0.7 per version: 0.25 * 0.5 * 0.49 = 0.06125) puts the old group last
    steep = select_batch(store, RUN, 2, 4, ReplayPolicy(2, 1.0, 3, "signal", staleness_decay=0.7))
    assert list(dict.fromkeys(steep.group_ids)) == ["new_narrow", "reused", "old_wide"]


def test_incomplete_groups_wait_and_runs_are_separate(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    store.append_trajectories(_group("a", 3, 3)[:2] + [_traj("o'ther", 0, 3, run="o'ther")], app_id="f",
                              txn_version=0)
    policy = ReplayPolicy(2, 0.0, 1)
    assert select_batch(store, RUN, 3, 4, policy, samples_per_prompt=3).trajectory_ids == []
    assert select_batch(store, RUN, 3, 4, policy).trajectory_ids == ["a/0", "a/1"]  # without the size check
    store.append_trajectories(_group("a", 3, 3)[2:], app_id="f", txn_version=1)
    assert len(select_batch(store, RUN, 3, 4, policy, samples_per_prompt=3).trajectory_ids) == 3
    assert select_batch(store, "o'ther", 3, 4, policy).trajectory_ids == ["o'ther/0"]


def test_sql_is_runnable_text_and_kept_tables_follow_new_commits(tmp_path: Path) -> None:
    store = DeltaTrajectoryStore(tmp_path)
    cached = DeltaTrajectoryStore(tmp_path)  # another reader: it keeps its tables open between queries
    assert cached.table_versions() == {"trajectories": -1, "usage": -1, "rollout_cache": -1}
    store.append_trajectories(_group("a", 0, 2), app_id="f", txn_version=0)
    sql = select_batch_sql(RUN, 0, 2, ReplayPolicy(0, 0.5, 2))
    assert "policy_version >= 0 AND policy_version <= 0" in sql and "trainer_version >= 0" in sql
    assert select_batch(cached, RUN, 0, 2, ReplayPolicy(0, 0.5, 2)).group_ids == ["a", "a"]
    store.append_usage(select_batch(store, RUN, 0, 2, ReplayPolicy(0, 0.5, 2)).usage_rows(RUN, 0, 0),
                       app_id="t", txn_version=0)
    store.append_trajectories(_group("b", 0, 2), app_id="f", txn_version=1)
    assert store.query(sql).column("trajectory_id").to_pylist() == ["b/0", "b/1", "a/0", "a/1"]
    assert cached.query(sql).column("trajectory_id").to_pylist() == ["b/0", "b/1", "a/0", "a/1"]  # new commits
    assert cached.table_versions() == store.table_versions()
    sel = select_batch(store, RUN, 0, 2, ReplayPolicy(0, 0.5, 2))  # the writer's window, fed by its commits
    assert sel.kinds == ["fresh", "fresh", "replay", "replay"] and sel.reuse_counts == [0, 0, 1, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_staleness_versions": -1}, "max_staleness_versions"), ({"replay_ratio": 1.5}, "replay_ratio"),
    ({"max_reuse": 0}, "max_reuse"), ({"replay_order": "oldest"}, "replay_order"),
])
def test_policy_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    fields = {"max_staleness_versions": 2, "replay_ratio": 0.5, "max_reuse": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        ReplayPolicy(**fields)  # type: ignore[arg-type]


def test_replay_weight_hand_computed() -> None:
    assert replay_weight(0, 0) == 1.0
    assert replay_weight(1, 0) == 0.5
    assert replay_weight(2, 3) == pytest.approx(0.25 * 0.729)  # .5^2 * .9^3
    assert replay_weight(1, 2, reuse_decay=1.0, staleness_decay=0.5) == 0.25
    # the default keeps a sample's total weight over any number of uses below 2 fresh samples
    assert sum(replay_weight(k, 0) for k in range(50)) < 2.0
    with pytest.raises(ValueError, match="reuse_decay"):
        replay_weight(1, 1, reuse_decay=0.0)
    assert math.isclose(replay_weight(0, 4), 0.9**4)
