"""``resources.weight_sync = "broadcast"``: the trainer actor broadcasts, the engine actors load what it sent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reflow.config.load import load_config
from reflow.policies.engines import EngineSettings


def _workers(model_dir: Path, store: Path, gpus: float = 0.0) -> tuple:
    import ray

    from reflow.infra.actors import EngineWorker, TrainerWorker
    from reflow.infra.placement import join_weight_group

    cfg = load_config(None, ['resources.weight_sync="broadcast"', "train.warm_up=false",
                             f"resources.engine_gpus={gpus}", f"resources.trainer_gpus={gpus}",
                             f'train.device="{"cuda" if gpus else "cpu"}"'])
    settings = EngineSettings(model_dir=str(model_dir), dtype="float32", temperature=1.0, eos_token_id=2,
                              max_model_len=128, max_concurrent_sequences=4, seed=0, threads=1)
    trainer = ray.remote(concurrency_groups={"read": 1, "sync": 1})(TrainerWorker).options(
        num_cpus=0.5, num_gpus=gpus).remote(str(model_dir), cfg.model_dump_json(), str(store), 1)
    engines = [ray.remote(EngineWorker).options(num_cpus=0.5, num_gpus=gpus).remote("transformers", settings)
               for _ in range(2)]
    join_weight_group(cfg, trainer, engines)
    return trainer, engines


def _check_broadcast(trainer, engines) -> None:
    import ray

    # move the trainer's weights away from the engines' (both started from the same directory)
    ray.get(trainer.__ray_call__.remote(lambda self: [p.data.add_(0.25) for p in self.trainer.model.parameters()]))
    weights = trainer.export_weights.remote()
    sent, seconds = ray.get([trainer.broadcast_weights.options(concurrency_group="sync").remote(weights, 7),
                             *(e.receive_weights.remote(7) for e in engines)])[0]
    expected = ray.get(weights)
    assert sent == sum(t.numel() * t.element_size() for t in expected.values()) and seconds > 0
    for engine in engines:
        assert ray.get(engine.version.remote()) == 7
        held = ray.get(engine.__ray_call__.remote(
            lambda self: {n: t.detach().cpu().clone() for n, t in self.engine.model.state_dict().items()}))
        worst = max(float((held[n] - expected[n]).abs().max()) for n in expected)
        print(f"largest difference between an engine's weights and the trainer's: {worst:.2e}")
        assert worst == 0.0


@pytest.mark.slow
def test_engines_load_exactly_what_the_trainer_broadcasts_over_gloo(random_model_dir: Path, tmp_path: Path,
                                                                   local_ray: None) -> None:
    _check_broadcast(*_workers(random_model_dir, tmp_path / "store"))


@pytest.mark.slow
def test_an_engine_outside_the_group_says_why(random_model_dir: Path, local_ray: None) -> None:
    import ray

    from reflow.infra.actors import EngineWorker

    settings = EngineSettings(model_dir=str(random_model_dir), dtype="float32", temperature=1.0, eos_token_id=2,
                              max_model_len=128, max_concurrent_sequences=4, seed=0, threads=1)
    engine = ray.remote(EngineWorker).options(num_cpus=0.5).remote("transformers", settings)
    with pytest.raises(ray.exceptions.RayTaskError, match="not in the weight broadcast group"):
        ray.get(engine.receive_weights.remote(1))


@pytest.mark.gpu
@pytest.mark.slow
def test_engines_load_exactly_what_the_trainer_broadcasts_over_nccl(random_model_dir: Path, tmp_path: Path,
                                                                   local_ray: None) -> None:
    if torch.cuda.device_count() < 3:  # NCCL puts each rank on a device of its own: a trainer and two engines
        pytest.skip(f"NCCL needs a GPU per rank: 3 here, {torch.cuda.device_count()} found")
    _check_broadcast(*_workers(random_model_dir, tmp_path / "store", gpus=1.0))
