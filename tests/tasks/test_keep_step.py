"""``tasks.lifecycle.keep_step``: a checkpoint is saved only once the deferred evaluations' snapshots are on disk."""

from __future__ import annotations

import time

import pytest

from reflow.config.load import load_config


@pytest.mark.slow
def test_a_checkpoint_waits_for_the_snapshots_of_its_steps(local_ray, monkeypatch, tmp_path) -> None:
    import ray

    from reflow.tasks import lifecycle

    @ray.remote(num_cpus=0)
    def slow_write(step: int) -> None:
        time.sleep(2.0)
        (tmp_path / f"snapshot-{step}").write_text("whole")

    def written() -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("snapshot-*"))

    order = []
    monkeypatch.setattr(lifecycle, "snapshot", lambda run_dir, step, version, weights: lifecycle.Snapshot(
        step, version, weights, slow_write.remote(step)))
    monkeypatch.setattr(lifecycle, "checkpoint", lambda run_dir, step: order.append((step, written())))
    cfg = load_config(None, ["run.total_steps=4", "eval.every_steps=2", "run.checkpoint_every_steps=2"])
    snapshots: list = []
    for step in range(4):
        lifecycle.keep_step(cfg, str(tmp_path), step, 3, step + 1, snapshots, weights=None)
    assert [s.step for s in snapshots] == [1, 3]
    assert order == [(1, [1]), (3, [1, 3])]  # each checkpoint came after the files of its step's snapshots
    lifecycle.keep_step(cfg, str(tmp_path), 3, 3, 4, None)  # inline evaluation: nothing to wait for
    assert order[-1] == (3, [1, 3])
