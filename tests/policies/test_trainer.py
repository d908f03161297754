from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from reflow.infra.config import TrainConfig
from reflow.policies.trainer import TrainSample, Trainer, pack_micro_batches


def test_pack_micro_batches_respects_budget_and_keeps_every_sample() -> None:
    lengths = [5, 50, 7, 20, 20, 3, 90]
    groups = pack_micro_batches(lengths, token_budget=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 60
    assert [6] in groups  # longer than the budget: alone


def _samples(n: int, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 100) for _ in range(rng.randrange(3, 9))]
        resp = [rng.randrange(4, 100) for _ in range(rng.randrange(1, 15))]
        out.append(TrainSample(prompt, resp, [-4.0] * len(resp), [1] * len(resp),
                               advantage=rng.uniform(-1, 1), loss_weight=1.0))
    return out


def _grads(model_dir: Path, budget: int, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    trainer = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget, learning_rate=1e-3), seed=0)
    trainer.optimizer.step = lambda: None  # keep weights, inspect gradients
    trainer.step(samples)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_micro_batching_does_not_change_the_gradient(random_model_dir: Path) -> None:
    samples = _samples(12)
    whole = _grads(random_model_dir, 100_000, samples)
    split = _grads(random_model_dir, 64, samples)
    for name in whole:
        assert torch.allclose(whole[name], split[name], atol=1e-5, rtol=1e-4), name


def test_step_raises_logprob_of_positive_advantage_response(random_model_dir: Path) -> None:
    trainer = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-2), seed=0)
    prompt, good, bad = [10, 11, 12], [20, 21, 22, 2], [30, 31, 2]

    def logp(resp: list[int]) -> float:
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp).unsqueeze(-1)).sum())

    before_good, before_bad = logp(good), logp(bad)
    for _ in range(5):
        trainer.step([TrainSample(prompt, good, [-4.85] * 4, [1] * 4, 1.0, 1.0),
                      TrainSample(prompt, bad, [-4.85] * 3, [1] * 3, -1.0, 1.0)])
    assert logp(good) > before_good + 1.0 and logp(bad) < before_bad - 1.0
    assert trainer.version == 5


def test_loss_mask_excludes_tokens(random_model_dir: Path) -> None:
    trainer = Trainer(str(random_model_dir), TrainConfig(), seed=0)
    masked = TrainSample([5, 6], [7, 8], [-4.0, -4.0], [0, 0], advantage=1.0, loss_weight=1.0)
    metrics = trainer.step([masked])
    assert metrics.trained_tokens == 0 and metrics.grad_norm == pytest.approx(0.0)


def test_tool_output_tokens_leave_the_loss_and_its_normaliser(random_model_dir: Path) -> None:
    """Response [7, 8, 9] with the middle token tool output (mask 0, placeholder log-prob 0.0).

    Decoupled loss on fresh data: r = 1, so loss_t = -w_t * A with w_t = exp(logp_t - behaviour_t).
    Behaviour = logp - log(1.5) on the policy tokens gives w = 1.5 there: token_mean over the 2 policy
    tokens is -1.5 * A; had the masked token counted, it would be (-3 - exp(logp_8)) * A / 3.
    """
    trainer = Trainer(str(random_model_dir), TrainConfig(), seed=0)
    prompt, response = [5, 6], [7, 8, 9]
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt + response])).logits[0, 1:-1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()
    shift = math.log(1.5)
    behaviour = [logp[0] - shift, 0.0, logp[2] - shift]
    metrics = trainer.step([TrainSample(prompt, response, behaviour, [1, 0, 1], advantage=2.0, loss_weight=1.0)])
    assert metrics.trained_tokens == 2
    assert metrics.loss == pytest.approx(-1.5 * 2.0, rel=1e-4)
    assert metrics.ratio_mean == pytest.approx(1.5, rel=1e-4)


def test_checkpoint_round_trip(random_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-2), seed=0)
    trainer.step(_samples(4))
    trainer.save_checkpoint(tmp_path / "ckpt")
    weights = trainer.export_weights()
    other = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-2), seed=0)
    assert other.load_checkpoint(tmp_path / "ckpt") == 1
    for name, value in other.export_weights().items():
        assert torch.equal(value, weights[name]), name
    out = trainer.save_hf(tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
