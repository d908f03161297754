"""A trainer sharded over two FSDP2 ranks (``resources.trainer_ranks = 2``: Ray actors in one gloo group).

The update must be the one-rank update on the same batch; checkpoints are sharded and resume only onto as
many ranks as wrote them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reflow.config.schema import ReflowConfig
from reflow.policies.trainer import split_by_tokens


def test_split_by_tokens_balances_the_shares_and_keeps_every_sample() -> None:
    lengths = [90, 5, 50, 7, 20, 20, 3, 41]
    shares = split_by_tokens(lengths, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(lengths[i] for i in range(len(lengths)) if lengths[i] < 90)
    assert split_by_tokens([4], 3) == [[0], [], []]  # fewer samples than ranks: empty shares


def _batch(store_root: Path) -> tuple[list[str], list[float]]:
    """Four GRPO groups of four (one with equal rewards, so its samples are skipped) of uneven lengths."""
    import random

    from reflow.storage.delta_store import DeltaTrajectoryStore
    from reflow.storage.schema import Trajectory

    rng = random.Random(3)
    rows = []
    for g in range(4):
        for k in range(4):
            n = rng.randrange(2, 30)
            rows.append(Trajectory(
                trajectory_id=f"r/g{g}/{k}", run_id="r", prompt_id=f"p{g}", group_id=f"r/g{g}", sample_index=k,
                env="arith", rollout_step=0, policy_version=0, prompt_tokens=[rng.randrange(4, 60) for _ in range(6)],
                response_tokens=[rng.randrange(4, 60) for _ in range(n)], behaviour_logprobs=[-3.0] * n,
                token_versions=[0] * n, loss_mask=[1] * n, reward=0.0 if g == 3 else float(k % 2),
                correct=g != 3 and bool(k % 2), finish_reason="stop", response_length=n))
    DeltaTrajectoryStore(str(store_root)).append_trajectories(rows, app_id="r:trajectories", txn_version=0)
    return [r.trajectory_id for r in rows], [1.0, 0.5] * 8


def _config(ranks: int) -> str:
    # several micro-batches, not as many on each rank
    return ReflowConfig.model_validate({
        "train": {"micro_batch_tokens": 64, "learning_rate": 1e-3, "warm_up": False},
        "resources": {"trainer_ranks": ranks, "trainer_cpus": 0.5}}).model_dump_json()




@pytest.mark.slow
def test_two_fsdp_ranks_make_the_one_rank_update_and_checkpoint_sharded(random_model_dir: Path, tmp_path: Path,
                                                                       local_ray: None) -> None:
    import ray

    from reflow.infra.actors import TrainerWorker, in_bundle
    from reflow.infra.placement import trainer_placement_group

    def start_sharded() -> ray.actor.ActorHandle:  # as launch_workers starts it: rank 0 in the group's first bundle
        group = trainer_placement_group(ReflowConfig.model_validate_json(_config(2)))
        return ray.remote(TrainerWorker).options(num_cpus=0.5, scheduling_strategy=in_bundle(group, 0)).remote(
            str(random_model_dir), _config(2), str(tmp_path / "tables"), 1, None, None, group)

    ids, weights = _batch(tmp_path / "tables")
    one = TrainerWorker(str(random_model_dir), _config(1), str(tmp_path / "tables"), threads=1)
    two = start_sharded()
    ranks = ray.get(two.ranks.remote())
    assert len(ranks) == 2 and ranks[0][0] != ranks[1][0]  # two processes

    want = one.train("r", ids, weights, (0, 0))
    got = ray.get(two.train.remote("r", ids, weights, (0, 0)))
    before = {n: t.clone() for n, t in one.export_weights().items()}
    sharded = ray.get(two.export_weights.remote())
    worst = max(float((sharded[n] - before[n]).abs().max()) for n in before)
    print(f"max abs parameter difference, 2 FSDP2 ranks vs 1 rank after one step: {worst:.3g}")
    assert worst <= 1e-5
    moved = max(float((before[n] - t).abs().max()) for n, t in
                TrainerWorker(str(random_model_dir), _config(1), str(tmp_path / "tables"), 1).export_weights().items())
    assert moved > 1e-4, "the step did not change the weights: the comparison shows nothing"
    assert got.version == want.version == 1
    assert got.trained_tokens == want.trained_tokens and got.skipped_samples == want.skipped_samples == 4
    for field in ("loss", "entropy", "clip_fraction", "importance_ratio_mean", "grad_norm"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-4, abs=1e-6), field

    # a sharded checkpoint: each rank's shard and RNG, and trainer.pt (full weights, version, ranks) last
    ckpt = tmp_path / "step-0"
    ray.get(two.save_checkpoint.remote(str(ckpt)))
    assert (ckpt / "trainer.pt").is_file() and (ckpt / "sharded/.metadata").is_file()
    assert sorted(p.name for p in ckpt.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    assert state["ranks"] == 2 and state["version"] == 1 and "optimizer" not in state
    continued = ray.get(two.train.remote("r", ids, weights, (0, 0)))
    after_two = ray.get(two.export_weights.remote())
    ray.kill(two)

    again = start_sharded()
    assert ray.get(again.load_checkpoint.remote(str(ckpt))) == 1
    resumed = ray.get(again.train.remote("r", ids, weights, (0, 0)))
    assert resumed.loss == pytest.approx(continued.loss, rel=1e-6)
    for name, value in ray.get(again.export_weights.remote()).items():  # optimiser moments restored too
        assert torch.allclose(value, after_two[name], atol=1e-7), name
    ray.kill(again)

    with pytest.raises(ValueError, match=r"saved by 2 trainer rank\(s\) and this trainer has 1: resume with "
                                         r"resources.trainer_ranks=2"):
        one.load_checkpoint(str(ckpt))
