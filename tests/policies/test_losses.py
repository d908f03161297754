"""Losses and advantage estimators are found by the names the config allows; hand-computed values."""

from __future__ import annotations

import typing

import pytest
import torch

from reflow.config.schema import TrainConfig
from reflow.policies import grpo, losses


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
    loss, clipped = losses.get_policy_loss("ppo")(logp, behaviour, torch.tensor([1.0]), cfg)
    # ratio 2 with A = 1 is clipped at 1.28: -min(2, 1.28) = -1.28; ratio 1: -1
    assert loss[0].tolist() == pytest.approx([-1.28, -1.0], rel=1e-6)
    assert clipped.tolist() == [[1.0, 0.0]]


def test_decoupled_weights_each_token_by_its_capped_behaviour_ratio() -> None:
    cfg = TrainConfig(is_weight_cap=2.0)
    logp = torch.log(torch.tensor([[0.5, 0.6]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.4]]))  # weights min(5, 2) = 2 and 1.5
    loss, capped = losses.get_policy_loss("decoupled")(logp, behaviour, torch.tensor([-1.0]), cfg)
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
    ppo, _ = losses.get_policy_loss("ppo")(logp, behaviour, negative, TrainConfig(clip_ratio_c=3.0))
    assert ppo.item() == pytest.approx(3.0, rel=1e-5)  # -c * A, not rho = 5
    # decoupled: r = 1 against the proximal (current) weights, so the dual clip cannot engage: loss = -w * A
    dec, _ = losses.get_policy_loss("decoupled")(logp, behaviour, negative, TrainConfig(clip_ratio_c=3.0))
    assert dec.item() == pytest.approx(2.0, rel=1e-5)  # w = min(5, is_weight_cap 2)
