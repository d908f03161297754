from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from reflow.config.schema import TrainConfig
from reflow.policies.trainer import GradientShare, Trainer, TrainSample, pack_micro_batches


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


def _grads(model_dir: Path, budget: int, samples: list[TrainSample], **cfg) -> dict[str, torch.Tensor]:
    trainer = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget, learning_rate=1e-3, **cfg), seed=0)
    trainer.optimizer.step = lambda: None  # keep weights, inspect gradients
    trainer.step(samples)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_micro_batching_does_not_change_the_gradient(random_model_dir: Path) -> None:
    samples = _samples(12)
    whole = _grads(random_model_dir, 100_000, samples)
    split = _grads(random_model_dir, 64, samples)
    for name in whole:
        assert torch.allclose(whole[name], split[name], atol=1e-5, rtol=1e-4), name


def _with_zero_advantage(samples: list[TrainSample], every: int) -> list[TrainSample]:
    return [TrainSample(s.prompt_tokens, s.response_tokens, s.behaviour_logprobs, s.loss_mask,
                        0.0 if i % every == 0 else s.advantage, s.loss_weight) for i, s in enumerate(samples)]


@pytest.mark.parametrize("policy_loss", ["decoupled", "ppo"])
def test_skipping_zero_advantage_samples_leaves_the_gradient_unchanged(random_model_dir: Path,
                                                                       policy_loss: str) -> None:
    samples = _with_zero_advantage(_samples(12, seed=1), every=3)
    skipped = _grads(random_model_dir, 100_000, samples, policy_loss=policy_loss)
    computed = _grads(random_model_dir, 100_000, samples, policy_loss=policy_loss, skip_zero_advantage=False)
    assert skipped.keys() == computed.keys()
    for name in computed:
        assert torch.allclose(skipped[name], computed[name], atol=1e-6, rtol=1e-5), name


def test_skipped_samples_count_in_the_normaliser_not_in_trained_tokens(random_model_dir: Path) -> None:
    samples = _with_zero_advantage(_samples(12, seed=2), every=2)
    zero_tokens = sum(sum(s.loss_mask) for s in samples if s.advantage == 0.0)
    all_tokens = sum(sum(s.loss_mask) for s in samples)
    on = Trainer(str(random_model_dir), TrainConfig(), seed=0).step(samples)
    off = Trainer(str(random_model_dir), TrainConfig(skip_zero_advantage=False), seed=0).step(samples)
    assert (on.skipped_samples, on.skipped_tokens, on.trained_tokens) == (6, zero_tokens, all_tokens - zero_tokens)
    assert (off.skipped_samples, off.skipped_tokens, off.trained_tokens) == (0, 0, all_tokens)
    assert on.loss == pytest.approx(off.loss, rel=1e-5) and on.grad_norm == pytest.approx(off.grad_norm, rel=1e-5)


def test_nothing_is_skipped_with_a_kl_term(random_model_dir: Path) -> None:
    samples = _with_zero_advantage(_samples(6, seed=3), every=2)
    metrics = Trainer(str(random_model_dir), TrainConfig(kl_coef=0.1), seed=0).step(samples)
    assert metrics.skipped_samples == 0


def test_an_all_zero_batch_still_steps_adam_with_a_zero_gradient(random_model_dir: Path) -> None:
    """A fully skipped batch must move the weights exactly as a computed zero gradient does (Adam's momentum)."""
    warm, flat = _samples(4, seed=4), _with_zero_advantage(_samples(4, seed=5), every=1)
    finals = []
    for skip in (True, False):
        trainer = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-2, skip_zero_advantage=skip), seed=0)
        trainer.step(warm)
        before = trainer.export_weights()
        metrics = trainer.step(flat)
        assert metrics.skipped_samples == (4 if skip else 0) and metrics.grad_norm == 0.0
        after = trainer.export_weights()
        assert any(not torch.equal(before[n], after[n]) for n in after)  # momentum still moves the weights
        finals.append(after)
    for name in finals[0]:
        assert torch.allclose(finals[0][name], finals[1][name], atol=1e-7), name


def _weighted(samples: list[TrainSample], weights: list[float]) -> list[TrainSample]:
    return [TrainSample(s.prompt_tokens, s.response_tokens, s.behaviour_logprobs, s.loss_mask, s.advantage, w)
            for s, w in zip(samples, weights)]


def test_lr_by_weight_scales_the_step_by_the_mean_weight_of_the_samples_trained_on(random_model_dir: Path) -> None:
    """Adam's first step is lr * sign(g) per coordinate: with the rate scaled, the weights move 0.5x as far."""
    # weights 1, 0.5, 0.25, 0.25 on samples with a gradient (mean 0.5); the zero-advantage one is skipped
    samples = _with_zero_advantage(_weighted(_samples(5, seed=6), [0.1, 1.0, 0.5, 0.25, 0.25]), every=5)
    deltas, rates = [], []
    for scaled, skip in ((False, True), (True, True), (True, False)):
        trainer = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-3, lr_by_weight=scaled,
                                                             skip_zero_advantage=skip), seed=0)
        before = trainer.export_weights()
        metrics = trainer.step(samples)
        assert metrics.skipped_samples == (1 if skip else 0)
        rates.append(metrics.learning_rate)
        after = trainer.export_weights()
        deltas.append({n: after[n] - before[n] for n in after})
    assert rates == [pytest.approx(1e-3), pytest.approx(5e-4), pytest.approx(5e-4)]  # skipped or not
    # Adam's first step is lr * g / (|g| + eps): sign(g) only where |g| >> eps. Where g is near eps, the order in
    # which the skipped and the computed batch sum their gradients decides the step (a CPU-dependent rounding), so
    # compare the coordinates that took a full step at the full rate.
    full = {n: deltas[0][n].abs() > 0.99e-3 for n in deltas[0]}
    assert sum(int(m.sum()) for m in full.values()) > 0.5 * sum(m.numel() for m in full.values())
    for name, mask in full.items():
        assert torch.allclose(deltas[1][name][mask], 0.5 * deltas[0][name][mask], atol=1e-6), name
        assert torch.allclose(deltas[2][name][mask], deltas[1][name][mask], atol=1e-6), name


def test_lr_by_weight_keeps_the_full_rate_for_a_batch_with_nothing_to_train(random_model_dir: Path) -> None:
    flat = _with_zero_advantage(_weighted(_samples(3, seed=7), [0.2, 0.2, 0.2]), every=1)
    trainer = Trainer(str(random_model_dir), TrainConfig(learning_rate=1e-3, lr_by_weight=True), seed=0)
    assert trainer.step(flat).learning_rate == pytest.approx(1e-3)


def test_minibatches_keep_every_sample_and_give_each_one_with_a_gradient(random_model_dir: Path) -> None:
    samples = _with_zero_advantage(_samples(11, seed=8), every=4)  # 3 of 11 have advantage 0
    trainer = Trainer(str(random_model_dir), TrainConfig(), seed=0)
    parts = trainer.minibatches(samples, 3)
    assert sorted(id(s) for part in parts for s in part) == sorted(id(s) for s in samples)
    assert all(any(s.advantage != 0.0 for s in part) for part in parts)
    tokens = [sum(len(s.prompt_tokens) + len(s.response_tokens) for s in part if s.advantage != 0.0) for part in parts]
    longest = max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    assert max(tokens) - min(tokens) <= longest  # dealt by tokens: balanced within one sample


def test_with_proximal_records_each_response_token_log_prob_under_the_current_weights(
        random_model_dir: Path) -> None:
    samples = _samples(5, seed=9)
    trainer = Trainer(str(random_model_dir), TrainConfig(micro_batch_tokens=64), seed=0)
    recorded = trainer.with_proximal(samples)
    for s, r in zip(samples, recorded):
        ids = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, :-1]
        expected = torch.log_softmax(logits.float(), -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
        assert r.proximal_logprobs == pytest.approx(expected[len(s.prompt_tokens) - 1:].tolist(), abs=1e-5)
        assert s.proximal_logprobs is None  # the input is not changed


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_several_minibatches_are_as_many_optimiser_steps_and_one_version(random_model_dir: Path) -> None:
    """ppo ignores the proximal log-probs: k minibatches equal k one-minibatch steps on the same split."""
    samples = _with_zero_advantage(_samples(12, seed=10), every=5)
    split = Trainer(str(random_model_dir), TrainConfig(policy_loss="ppo", minibatches_per_step=3,
                                                       learning_rate=1e-2), seed=0)
    parts = split.minibatches(samples, 3)
    metrics = split.step(samples)
    assert metrics.version == split.version == 1
    assert metrics.trained_tokens == sum(sum(s.loss_mask) for s in samples if s.advantage != 0.0)
    one_by_one = Trainer(str(random_model_dir), TrainConfig(policy_loss="ppo", learning_rate=1e-2), seed=0)
    for part in parts:
        one_by_one.step(part)
    a, b = _params(split), _params(one_by_one)
    assert max(float((a[n] - b[n]).abs().max()) for n in a) < 1e-6


def test_later_minibatches_clip_against_the_weights_the_step_started_from(random_model_dir: Path) -> None:
    """decoupled: the first minibatch sees r = 1; later ones see r != 1 and the clip engages (and differs from
    re-anchoring every minibatch, which is what k one-minibatch steps would do)."""
    samples = _samples(12, seed=11)
    cfg = {"minibatches_per_step": 4, "learning_rate": 5e-2, "clip_eps_low": 0.01, "clip_eps_high": 0.01,
           "is_weight_cap": 100.0}  # no weight is capped: what is reported is the clip alone
    split = Trainer(str(random_model_dir), TrainConfig(**cfg), seed=0)
    parts = split.minibatches(samples, 4)
    metrics = split.step(samples)
    assert metrics.clip_fraction > 0.0  # with r = 1 everywhere (one step per batch) it could not be
    reanchored = Trainer(str(random_model_dir), TrainConfig(**(cfg | {"minibatches_per_step": 1})), seed=0)
    clipped = [reanchored.step(part).clip_fraction for part in parts]
    assert clipped == [0.0] * 4
    a, b = _params(split), _params(reanchored)
    assert max(float((a[n] - b[n]).abs().max()) for n in a) > 1e-4


def test_minibatches_are_cut_to_the_samples_with_a_gradient(random_model_dir: Path) -> None:
    samples = _with_zero_advantage(_samples(6, seed=12), every=1)
    samples[2] = TrainSample(samples[2].prompt_tokens, samples[2].response_tokens, samples[2].behaviour_logprobs,
                             samples[2].loss_mask, advantage=0.5, loss_weight=1.0)
    trainer = Trainer(str(random_model_dir), TrainConfig(minibatches_per_step=4), seed=0)
    trainer.step(samples)
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {1}  # one optimiser step: one sample has a gradient


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
    assert metrics.importance_ratio_mean == pytest.approx(1.5, rel=1e-4)


def test_warm_up_changes_nothing_a_step_depends_on(random_model_dir: Path) -> None:
    cfg = TrainConfig(micro_batch_tokens=256, learning_rate=1e-3)
    cold, warm = Trainer(str(random_model_dir), cfg, seed=0), Trainer(str(random_model_dir), cfg, seed=0)
    rng = torch.get_rng_state()
    assert warm.warm_up(40) > 0
    assert torch.equal(torch.get_rng_state(), rng) and warm.version == 0 and not warm.optimizer.state
    assert all(p.grad is None for p in warm.model.parameters())
    for a, b in zip(cold.model.parameters(), warm.model.parameters()):
        assert torch.equal(a, b)
    samples = _samples(10, seed=3)
    m_cold, m_warm = cold.step(samples), warm.step(samples)
    assert m_cold.loss == m_warm.loss and m_cold.grad_norm == m_warm.grad_norm
    for a, b in zip(cold.model.parameters(), warm.model.parameters()):
        assert torch.equal(a, b)


RESIDENT_SCRIPT = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
before = rss()
blocks = [libc.malloc(1 << 20) for _ in range(256)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
held = rss()
for b in blocks:
    libc.free(b)
print(held - before, rss() - before)
"""


def test_worker_env_keeps_freed_memory_in_the_process() -> None:
    """glibc with ``RESIDENT_MALLOC``: 256 MiB of 1 MiB blocks freed stay resident (without it they go back)."""
    import os
    import subprocess
    import sys

    from reflow.infra.placement import RESIDENT_MALLOC, worker_env

    assert RESIDENT_MALLOC.items() <= worker_env(1, eager=True).items()

    def held_then_kept(extra: dict[str, str]) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", RESIDENT_SCRIPT], env={**env, **extra}, check=True,
                             capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])

    held, kept = held_then_kept({})
    assert held >= 250 and kept < 16  # plain glibc: each block its own mapping, unmapped by free
    held, kept = held_then_kept(RESIDENT_MALLOC)
    assert held >= 250 and kept >= 250


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


def test_trainer_worker_trains_each_logged_step_once(random_model_dir: Path, tmp_path: Path) -> None:
    """A step reaches the trainer at the version it was chosen for; one ``recover`` replayed is not trained twice.

    (Ray re-issues the call a dead trainer was running; its usage rows were
    logged as it started, so the restarted trainer has replayed it already.)
    """
    from reflow.config.schema import ReflowConfig
    from reflow.infra.actors import TrainerWorker
    from reflow.storage.delta_store import DeltaTrajectoryStore
    from reflow.storage.schema import Trajectory, Usage

    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    rows = [Trajectory(trajectory_id=f"r/g0/{k}", run_id="r", prompt_id="p0", group_id="r/g0", sample_index=k,
                       env="arith", rollout_step=0, policy_version=0, prompt_tokens=[5, 6],
                       response_tokens=[7 + k, 8], behaviour_logprobs=[-1.0, -1.0], token_versions=[0, 0],
                       loss_mask=[1, 1], reward=float(k % 2), correct=bool(k % 2), finish_reason="stop",
                       response_length=2) for k in range(4)]
    store.append_trajectories(rows, app_id="r:trajectories", txn_version=0)
    ids, weights = [r.trajectory_id for r in rows], [1.0] * 4
    config = ReflowConfig().model_dump_json()
    worker = TrainerWorker(str(random_model_dir), config, str(tmp_path / "tables"), threads=1)
    with pytest.raises(RuntimeError, match="version 1 reached the trainer at version 0"):
        worker.train("r", ids, weights, (0, 0), expect_version=1)
    first = worker.train("r", ids, weights, (0, 0), expect_version=0)
    assert worker.version() == 1 and first.version == 1

    # step 0 was logged, and the trainer died while computing it: a new one replays it from the usage log
    store.append_usage([Usage(run_id="r", trajectory_id=t, trainer_step=0, trainer_version=0, loss_weight=1.0,
                              staleness=0) for t in ids], app_id="r:usage", txn_version=0)
    restarted = TrainerWorker(str(random_model_dir), config, str(tmp_path / "tables"), threads=1)
    assert restarted.recover(str(tmp_path / "run"), "r") == 1
    reissued = restarted.train("r", ids, weights, (0, 0), expect_version=0)
    assert restarted.version() == 1, "the re-issued step was trained a second time"
    assert reissued.loss == pytest.approx(first.loss)
    for name, value in restarted.export_weights().items():
        assert torch.equal(value, worker.export_weights()[name]), name


def test_a_worker_used_outside_ray_starts_no_ray(random_model_dir: Path, tmp_path: Path) -> None:
    """``ray.get([])`` and ``ray.get_runtime_context()`` start a local Ray when none runs: a one-rank trainer
    worker used directly (as the unit tests do) left one running for the rest of the session, and the next
    ``ray.init`` (a test's own Ray) failed."""
    import ray

    from reflow.config.schema import ReflowConfig
    from reflow.infra.actors import TrainerWorker, _restarted

    assert not ray.is_initialized(), "a test before this one left Ray running"
    worker = TrainerWorker(str(random_model_dir), ReflowConfig().model_dump_json(), str(tmp_path / "tables"),
                           threads=1)
    assert worker.export_weights() and _restarted() is False
    assert not ray.is_initialized()


def test_trainer_worker_trains_on_the_batch_it_prefetched(random_model_dir: Path, tmp_path: Path) -> None:
    """``prefetch`` reads a batch beside the step under way; ``train`` takes it only for the same batch."""
    from reflow.config.schema import ReflowConfig
    from reflow.infra.actors import TrainerWorker
    from reflow.storage.delta_store import DeltaTrajectoryStore
    from reflow.storage.schema import Trajectory

    store = DeltaTrajectoryStore(str(tmp_path / "tables"))
    rows = [Trajectory(trajectory_id=f"r/g{g}/{k}", run_id="r", prompt_id=f"p{g}", group_id=f"r/g{g}",
                       sample_index=k, env="arith", rollout_step=0, policy_version=0, prompt_tokens=[5, 6],
                       response_tokens=[7 + k, 8 + g], behaviour_logprobs=[-1.0, -1.0], token_versions=[0, 0],
                       loss_mask=[1, 1], reward=float(k % 2), correct=bool(k % 2), finish_reason="stop",
                       response_length=2) for g in range(2) for k in range(4)]
    store.append_trajectories(rows, app_id="r:trajectories", txn_version=0)
    ids = [r.trajectory_id for r in rows]
    config = ReflowConfig().model_dump_json()
    plain = TrainerWorker(str(random_model_dir), config, str(tmp_path / "tables"), threads=1)
    early = TrainerWorker(str(random_model_dir), config, str(tmp_path / "tables"), threads=1)
    batches = [(ids[:4], [1.0] * 4), (ids[4:], [0.5] * 4), (ids, [1.0] * 8)]
    # the third step's batch is prefetched, then a different one arrives: it is read by train itself
    prefetch = [batches[0], batches[1], (ids[:4], [1.0] * 4)]
    hits = []
    for (batch, weights), (pre_ids, pre_weights) in zip(batches, prefetch):
        early.prefetch("r", pre_ids, pre_weights, (0, 0))
        got, want = early.train("r", batch, weights, (0, 0)), plain.train("r", batch, weights, (0, 0))
        assert got.loss == pytest.approx(want.loss) and got.batch == want.batch
        hits.append((got.trainer_batch_prefetched, want.trainer_batch_prefetched))
    assert hits == [(True, False), (True, False), (False, False)]  # logged as trainer_batch_prefetched
    assert early.prefetch_hits == 2 and plain.prefetch_hits == 0
    for name, value in early.export_weights().items():
        assert torch.equal(value, plain.export_weights()[name]), name
    early.prefetch("r", ["r/g9/0"], [1.0], (0, 0))  # a failed read is left to train, which reports it
    with pytest.raises(RuntimeError, match="1 trajectories selected, 0 found"):
        early.train("r", ["r/g9/0"], [1.0], (0, 0))


class _InProcessHelper:
    """A flex worker in this process: a second ``Trainer`` that only computes gradients (loads weights first)."""

    def __init__(self, model_dir: Path, cfg: TrainConfig, source: Trainer) -> None:
        self.worker = Trainer(str(model_dir), cfg, seed=1)  # other seed: nothing may depend on it
        self.source, self.loads, self.samples = source, 0, 0

    def start(self, samples: list[TrainSample], normaliser: float, weights_id: int) -> GradientShare:
        if self.worker.weights_id != weights_id:
            self.worker.load_weights({k: v.clone() for k, v in self.source.model.state_dict().items()}, weights_id)
            self.loads += 1
        self.samples += len(samples)
        return self.worker.gradients(samples, normaliser)

    def collect(self, handle: GradientShare) -> GradientShare:
        return handle


@pytest.mark.parametrize("cfg", [{}, {"minibatches_per_step": 2}, {"kl_coef": 0.05, "loss_agg": "seq_mean"}],
                         ids=["one-step", "two-minibatches", "kl-seq-mean"])
def test_a_step_shared_with_helpers_equals_the_one_trainer_step(random_model_dir: Path, cfg: dict) -> None:
    """The elastic pool's exactness: the same batches trained by 1 trainer, or by 1 trainer + 1 or 2 helpers,
    give the same parameters within 1e-5 (three steps: the helpers reload the weights each step).

    Per-token weights: three AdamW steps turn the float noise of a differently packed forward pass (about
    1e-6 of a gradient, every level: the test below) into parameter differences up to 7e-6 with them, and up
    to 1.3e-4 with a weight per sequence, whose one weight carries the noise of all its tokens."""
    config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=64, is_level="token", **cfg)
    batches = [_with_zero_advantage(_samples(10, seed=20 + i), every=4) for i in range(3)]
    alone = Trainer(str(random_model_dir), config, seed=0)
    for batch in batches:
        alone.step(batch)
    for n_helpers in (1, 2):
        shared = Trainer(str(random_model_dir), config, seed=0)
        helpers = [_InProcessHelper(random_model_dir, config, shared) for _ in range(n_helpers)]
        steps = [shared.step(batch, helpers) for batch in batches]
        assert all(h.samples > 0 for h in helpers), "a helper trained on nothing: the test would prove nothing"
        assert all(s.helpers == n_helpers and 0 < s.helper_samples for s in steps)
        assert all(h.loads == 3 * config.minibatches_per_step for h in helpers)  # new weights every optimiser step
        a, b = _params(alone), _params(shared)
        assert max(float((a[n] - b[n]).abs().max()) for n in a) < 1e-5
        assert shared.version == alone.version == 3


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("cfg", [{}, {"kl_coef": 0.05, "loss_agg": "seq_mean"}], ids=["plain", "kl-seq-mean"])
def test_a_shared_step_has_the_one_trainer_gradient_at_every_weight_level(random_model_dir: Path, level: str,
                                                                           cfg: dict) -> None:
    """One step's summed gradient with 2 helpers equals the trainer's alone within 1e-5 of its scale, whatever
    ``train.is_level``: a sequence's weight comes from its own tokens, wherever they are computed."""
    config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=64, is_level=level, **cfg)
    batch = _with_zero_advantage(_samples(10, seed=20), every=4)
    grads = []
    for n_helpers in (0, 2):
        trainer = Trainer(str(random_model_dir), config, seed=0)
        trainer.optimizer.step = lambda: None  # keep the gradients of the step, not its update
        helpers = [_InProcessHelper(random_model_dir, config, trainer) for _ in range(n_helpers)]
        trainer.step(batch, helpers)
        assert all(h.samples > 0 for h in helpers)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    alone, shared = grads
    worst = max(float((alone[n] - shared[n]).abs().max() / alone[n].abs().max().clamp(min=1e-12)) for n in alone)
    print(f"largest gradient difference, relative to the parameter's largest gradient: {worst:.2e}")
    assert worst < 1e-5
