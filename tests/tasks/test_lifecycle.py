"""``tasks.lifecycle``: a checkpoint waits for the snapshots of its steps; teardown releases the writer lock."""

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


def test_a_ctrl_c_while_the_workers_stop_still_releases_the_writer_lock(monkeypatch, tmp_path) -> None:
    from reflow.infra.run import RunRecord
    from reflow.infra.runlock import WriterLock, read_lock
    from reflow.tasks import lifecycle

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(RunRecord(
        run_id="r", run_dir=str(run_dir), store_root=str(run_dir / "tables"), model_dir="m", namespace="ns",
        engines=("e0",), trainer="t", tracking_uri="none").model_dump_json())
    lock = WriterLock([run_dir / "writer.lock"], "r").acquire()
    assert read_lock(run_dir / "writer.lock") is not None
    monkeypatch.setitem(lifecycle._LOCKS, str(run_dir), lock)

    def interrupted(placement) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "stop_workers", interrupted)
    try:
        lifecycle.teardown(str(run_dir), failed=True)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt was swallowed")
    assert read_lock(run_dir / "writer.lock") is None
