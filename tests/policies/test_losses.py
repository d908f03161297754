"""Losses and advantage estimators are found by the names the config allows; hand-computed values."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from reflow.config.schema import TrainConfig
from reflow.policies import grpo, losses


def _inputs(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
            proximal: torch.Tensor | None = None) -> losses.LossInputs:
    return losses.LossInputs(logp, behaviour, advantages, torch.ones_like(behaviour), proximal)


def test_every_name_the_config_allows_is_registered() -> None:
    allowed = typing.get_args(TrainConfig.model_fields["policy_loss"].annotation)
    assert set(allowed) == set(losses.policy_losses())
    allowed = typing.get_args(TrainConfig.model_fields["advantage_estimator"].annotation)
    assert set(allowed) == set(losses.advantage_estimators())


def test_unknown_names_and_second_registrations_are_refused() -> None:
    with pytest.raises(ValueError, match="no loss named 'nope'; registered: decoupled, ppo"):
        losses.get_policy_loss("nope")
    with pytest.raises(ValueError, match="registered: dr_grpo, grpo"):
        losses.get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        losses.register_policy_loss("ppo")(losses.ppo_loss)


def test_ppo_is_the_clipped_surrogate_against_the_behaviour_policy() -> None:
    cfg = TrainConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    logp = torch.log(torch.tensor([[0.5, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.9]]))  # ratio 2.0, then 1.0
    loss, clipped = losses.get_policy_loss("ppo")(_inputs(logp, behaviour, torch.tensor([1.0])), cfg)
    # ratio 2 with A = 1 is clipped at 1.28: -min(2, 1.28) = -1.28; ratio 1: -1
    assert loss[0].tolist() == pytest.approx([-1.28, -1.0], rel=1e-6)
    assert clipped.tolist() == [[1.0, 0.0]]


def test_decoupled_weights_each_token_by_its_capped_behaviour_ratio() -> None:
    cfg = TrainConfig(is_weight_cap=2.0, is_level="token")
    logp = torch.log(torch.tensor([[0.5, 0.6]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.4]]))  # weights min(5, 2) = 2 and 1.5
    loss, capped = losses.get_policy_loss("decoupled")(_inputs(logp, behaviour, torch.tensor([-1.0])), cfg)
    # the proximal policy is the current weights: r = 1, so loss_t = -w_t * A
    assert loss[0].tolist() == pytest.approx([2.0, 1.5], rel=1e-6)
    assert capped.tolist() == [[1.0, 0.0]]
    loss.sum().backward()  # d/dlogp of -w * r * A with r = exp(logp - logp.detach()) is -w * A
    assert logp.grad[0].tolist() == pytest.approx([2.0, 1.5], rel=1e-6)


def test_grpo_divides_by_the_group_std_and_dr_grpo_does_not() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, population std 0.5 -> +-1 (eps 1e-6); group 1: equal rewards -> 0
    assert losses.get_advantage_estimator("grpo")(rewards, groups, TrainConfig()).tolist() == pytest.approx(
        [1.0, -1.0, -1.0, 1.0, 0.0, 0.0], rel=1e-5)
    assert losses.get_advantage_estimator("dr_grpo")(rewards, groups, TrainConfig()).tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    assert torch.equal(losses.grpo_advantages(rewards, groups, TrainConfig()), grpo.group_advantages(rewards, groups))
    unbiased = losses.grpo_advantages(rewards, groups, TrainConfig(advantage_std="unbiased"))
    assert torch.equal(unbiased, grpo.group_advantages(rewards, groups, unbiased_std=True))


def test_the_configured_dual_clip_reaches_both_losses() -> None:
    logp = torch.log(torch.tensor([[0.5]]))
    behaviour = torch.log(torch.tensor([[0.1]]))  # ratio 5 against the behaviour policy
    negative = torch.tensor([-1.0])
    ppo, _ = losses.get_policy_loss("ppo")(_inputs(logp, behaviour, negative), TrainConfig(clip_ratio_c=3.0))
    assert ppo.item() == pytest.approx(3.0, rel=1e-5)  # -c * A, not rho = 5
    # decoupled: r = 1 against the proximal (current) weights, so the dual clip cannot engage: loss = -w * A
    dec, _ = losses.get_policy_loss("decoupled")(_inputs(logp, behaviour, negative), TrainConfig(clip_ratio_c=3.0))
    assert dec.item() == pytest.approx(2.0, rel=1e-5)  # w = min(5, is_weight_cap 2)


def test_decoupled_clips_against_the_proximal_log_probs_when_given() -> None:
    # a later minibatch: the weights moved since the step began, logp = ln .6 against proximal ln .4 (r = 1.5);
    # behaviour ln .2 -> w = min(.4 / .2, cap 3) = 2; A = 1: -w * min(1.5, 1.28) = -2.56, clip active
    cfg = TrainConfig(is_weight_cap=3.0, clip_eps_low=0.2, clip_eps_high=0.28)
    logp = torch.log(torch.tensor([[0.6]])).requires_grad_()
    proximal, behaviour = torch.log(torch.tensor([[0.4]])), torch.log(torch.tensor([[0.2]]))
    loss, capped = losses.get_policy_loss("decoupled")(_inputs(logp, behaviour, torch.tensor([1.0]), proximal), cfg)
    assert loss.item() == pytest.approx(-2.56, rel=1e-6) and capped.tolist() == [[1.0]]  # the clip, not the cap
    loss.sum().backward()
    assert logp.grad.item() == 0.0  # clipped: no gradient pushes r further past 1 + eps_high
    # without proximal log-probs the anchor is logp itself: r = 1, loss -w' * A with w' = min(.6 / .2, 3) = 3
    loss, capped = losses.get_policy_loss("decoupled")(_inputs(logp.detach(), behaviour, torch.tensor([1.0])), cfg)
    assert loss.item() == pytest.approx(-3.0, rel=1e-6) and capped.tolist() == [[0.0]]


def test_decoupled_takes_the_configured_sequence_level_weight() -> None:
    # proximal = logp; behaviour so that the token log-ratios are ln 2 and ln 1.5 (mask 1, 1, 0):
    # sequence: w = 2 * 1.5 = 3 -> capped at 2.5 (truncate) or 0 (mask); geometric: sqrt(3) = 1.732
    logp = torch.log(torch.tensor([[0.6, 0.6, 0.6]]))
    behaviour = torch.log(torch.tensor([[0.3, 0.4, 0.01]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    inputs = losses.LossInputs(logp, behaviour, torch.tensor([-1.0]), mask)
    for level, mode, weight, capped in (("sequence", "truncate", 2.5, 1.0), ("sequence", "mask", 0.0, 1.0),
                                        ("geometric", "truncate", math.sqrt(3.0), 0.0)):
        cfg = TrainConfig(is_weight_cap=2.5, is_level=level, is_cap_mode=mode)
        loss, clip = losses.get_policy_loss("decoupled")(inputs, cfg)
        assert loss[0, :2].tolist() == pytest.approx([weight, weight], rel=1e-6), (level, mode)  # -w * A, A = -1
        assert clip[0, :2].tolist() == [capped, capped], (level, mode)
