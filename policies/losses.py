"""Policy losses and advantage estimators, registered by name and chosen by config.

As verl's ``core_algos`` registers them (``register_policy_loss`` /
``get_policy_loss_fn``), so the trainer calls one function whatever the
loss: ``get_policy_loss(train.policy_loss)`` and
``get_advantage_estimator(train.advantage_estimator)``. The formulas live in
``policies.grpo`` and ``policies.offpolicy`` (pure tensor functions with
their sources); what is registered here binds them to the config's fields.

Shapes: ``B`` samples, ``T`` response tokens (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reflow.config.schema import TrainConfig
from reflow.policies import grpo, offpolicy

# (logp, behaviour_logp, advantages, cfg) -> ((B, T) per-token loss, (B, T) float 1.0 where clipped or capped)
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TrainConfig], tuple[torch.Tensor, torch.Tensor]]
# (rewards (B,), dense group index (B,), cfg) -> advantages (B,)
AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, TrainConfig], torch.Tensor]

_POLICY_LOSSES: dict[str, PolicyLoss] = {}
_ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated function as policy loss ``name`` (``train.policy_loss``)."""
    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn
    return add


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError listing the registered ones."""
    if name not in _POLICY_LOSSES:
        raise ValueError(f"train.policy_loss: no loss named {name!r}; registered: {', '.join(sorted(_POLICY_LOSSES))}")
    return _POLICY_LOSSES[name]


def policy_losses() -> tuple[str, ...]:
    """The registered policy loss names."""
    return tuple(sorted(_POLICY_LOSSES))


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register the decorated function as advantage estimator ``name`` (``train.advantage_estimator``)."""
    def add(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return add


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name``; ValueError listing the registered ones."""
    if name not in _ADVANTAGE_ESTIMATORS:
        raise ValueError(f"train.advantage_estimator: no estimator named {name!r}; registered: "
                         f"{', '.join(sorted(_ADVANTAGE_ESTIMATORS))}")
    return _ADVANTAGE_ESTIMATORS[name]


def advantage_estimators() -> tuple[str, ...]:
    """The registered advantage estimator names."""
    return tuple(sorted(_ADVANTAGE_ESTIMATORS))


@register_policy_loss("ppo")
def ppo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
             cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate against the behaviour log-probs (``grpo.clipped_surrogate``; verl's default
    without rollout correction): ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``,
    ``rho = exp(logp - behaviour)``, and with ``train.clip_ratio_c`` the dual clip ``min(loss, -c A)`` for
    ``A < 0``."""
    return grpo.clipped_surrogate(logp, behaviour_logp, advantages, cfg.clip_eps_low, cfg.clip_eps_high,
                                  cfg.clip_ratio_c)


@register_policy_loss("decoupled")
def decoupled_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                   cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's decoupled PPO (``offpolicy.decoupled_ppo_loss``) with the current weights as the proximal policy.

    One optimiser step is taken per batch, so the proximal policy is the
    weights before the step, i.e. ``logp`` detached: the ratio ``r = 1`` (with
    its gradient) and neither the clip nor the dual clip engages; the capped behaviour weight
    ``w = min(exp(logp - behaviour), is_weight_cap)`` corrects stale and
    replayed tokens. The reported clip fraction is the share of tokens whose
    weight hit the cap.
    """
    per_token, _, _ = offpolicy.decoupled_ppo_loss(logp, logp.detach(), behaviour_logp, advantages,
                                                   cfg.clip_eps_low, cfg.clip_eps_high, cfg.is_weight_cap,
                                                   cfg.is_cap_mode, cfg.clip_ratio_c)
    capped = (torch.exp(logp.detach() - behaviour_logp) > cfg.is_weight_cap).float()
    return per_token, capped


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)`` (``grpo.group_advantages``), with the population std or,
    ``train.advantage_std = "unbiased"``, the sample std (verl's)."""
    return grpo.group_advantages(rewards, group_index, unbiased_std=cfg.advantage_std == "unbiased")


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): ``r - mean_group``,
    not divided by the group's std (which up-weights groups of nearly equal rewards)."""
    return grpo.group_advantages(rewards, group_index, scale_by_std=False)
