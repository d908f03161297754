"""The elastic pool end to end: one engine, one trainer and one flex worker on a local Ray, in async and reflow.

The scheduler runs ``pool.policy = "alternate"`` (the worker takes the other role
every dwell, 3 s here), so that it moves both ways within a short run whatever
the machine's speeds: the test is about the mechanism (switches, shares of
steps, nothing lost or doubled), not the band rule, which
tests/control/test_roles.py checks against synthetic stage speeds.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from deltalake import DeltaTable

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 24


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "engine"), [("async", "transformers"), ("reflow", "transformers"),
                                              pytest.param("async", "vllm", marks=pytest.mark.vllm)])
def test_a_flex_worker_switches_both_ways_and_loses_nothing(tmp_path: Path, reflow_process, mode: str,
                                                            engine: str) -> None:
    out = tmp_path / "runs"
    overrides = {"run.total_steps": TOTAL_STEPS, "mode.kind": f'"{mode}"', "resources.flex_workers": 1,
                 "resources.flex_cpus": 0, "rollout.engine": f'"{engine}"', "pool.dwell_s": 3,
                 "pool.window_s": 1, "pool.policy": '"alternate"', "pool.initial_role": '"train"',
                 "model.tiny.sft_steps": 800, "env.max_terms": 3,
                 "model.cache_dir": f'"{tmp_path / "models"}"'}
    args = ["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out)]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    run = reflow_process(args, tmp_path)
    # 95-130 s on an idle machine; a CI run with other work beside it once took over 300 s
    assert run.finish(timeout=600) == 0, run.output()
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    cfg = json.loads((run_dir / "config.json").read_text())
    group, batch = cfg["rollout"]["samples_per_prompt"], cfg["rollout"]["prompts_per_step"]

    # the scheduler's decisions: at least two switches, both ways, each with its reason
    lines = [json.loads(line) for line in (run_dir / "roles.jsonl").read_text().splitlines()]
    decisions = [d for d in lines if "reason" in d]
    finished = [d for d in lines if "switched" in d]  # each switch that finished, its direction and seconds
    assert {d["role"] for d in finished} == {"generate", "train"} and all(d["seconds"] >= 0 for d in finished)
    switches = [d for d in decisions if d["workers"]]
    assert len(switches) >= 2, [d["reason"] for d in decisions]
    assert {d["role"] for d in switches} == {"generate", "train"}
    assert all("worker 0 ->" in d["reason"] for d in switches)
    assert [d["role"] for d in switches][:2] == ["generate", "train"]
    steps = [json.loads(line)["metrics"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps[-1]["role_switches"] == len(switches)
    assert all(m["role_generators"] + m["role_trainers"] == 1 for m in steps)
    assert any(m.get("switch_seconds", -1) >= 0 for m in steps)  # left out of a step where no switch finished
    # the flex worker computed a share of some steps (samples with a gradient) and generated in others
    assert any(m["helpers"] == 1 and m["helper_samples"] > 0 for m in steps), steps
    assert any(m["helpers"] == 0 for m in steps)
    # pool.in_flight = "move": what the worker held as it moved to training is resumed on the engine. vLLM steps
    # its requests a token at a time, so a worker moving to training holds partial responses, and they move (63
    # in a run of the vllm case, 2026-12-07); the transformers engine samples a whole batch in one call, so it holds
    # nothing partial, only requests queued past its batch, and its cases have moved none at any switch. The lines
    # below check that what moved was neither lost nor doubled, and kept the versions of its tokens.
    moved = [m["requests_moved"] for m in steps]
    print("requests moved:", moved[-1])
    assert moved == sorted(moved), moved  # a running count
    if engine == "vllm":
        assert moved[-1] > 0, moved

    # nothing lost or doubled: each trajectory once, whole groups, every step a full batch of them
    rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table().to_pylist()
    traj = {r["trajectory_id"]: r for r in rows}
    assert len(traj) == len(rows), "a trajectory was written twice"
    assert set(Counter(r["group_id"] for r in rows).values()) == {group}
    # every token keeps the version that sampled it: the row's version is its oldest token's, none from the future
    assert all(r["policy_version"] == min(r["token_versions"], default=r["policy_version"]) for r in rows)
    usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table().to_pylist()
    assert {u["trainer_step"] for u in usage} == set(range(TOTAL_STEPS))
    for step in range(TOTAL_STEPS):
        used = [u for u in usage if u["trainer_step"] == step]
        assert len({u["trajectory_id"] for u in used}) == len(used)
        assert all(max(traj[u["trajectory_id"]]["token_versions"], default=0) <= u["trainer_version"] for u in used)
        groups = Counter(traj[u["trajectory_id"]]["group_id"] for u in used)
        assert set(groups.values()) == {group}
        if step > 0 or mode == "async":
            assert len(groups) == batch
    if mode == "async":  # nothing trained twice
        assert len({u["trajectory_id"] for u in usage}) == len(usage)


@pytest.mark.slow
def test_in_sync_the_flex_worker_generates_in_the_rollout_and_trains_in_every_update(tmp_path: Path,
                                                                                      reflow_process) -> None:
    """verl's colocated hybrid engine: the flex worker computes a share of every update (and is dealt a share of
    every round, as any engine is)."""
    out = tmp_path / "runs"
    args = ["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out), "--set", "run.total_steps=4",
            "--set", 'mode.kind="sync"', "--set", "resources.flex_workers=1", "--set", "resources.flex_cpus=0",
            "--set", 'rollout.engine="transformers"', "--set", "model.tiny.sft_steps=800", "--set", "env.max_terms=3",
            "--set", f'model.cache_dir="{tmp_path / "models"}"']
    run = reflow_process(args, tmp_path)
    assert run.finish() == 0, run.output()
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    steps = [json.loads(line)["metrics"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [m["helpers"] for m in steps] == [1] * 4
    assert sum(m["helper_samples"] for m in steps) > 0, steps
    assert not (run_dir / "roles.jsonl").exists()  # no scheduler in the round modes
