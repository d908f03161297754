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

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reflow.config.schema import TrainConfig
from reflow.policies import grpo, offpolicy


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees of one micro-batch."""

    logp: torch.Tensor  # (B, T) log-probs of the policy being optimised (carries the gradient)
    behaviour_logp: torch.Tensor  # (B, T) log-probs of the policy that sampled each token (the engine's)
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) 1.0 on loss tokens
    # (B, T) log-probs under the weights at the start of the step (``train.minibatches_per_step > 1``);
    # None: one optimiser step per batch, so the proximal policy is ``logp`` detached
    proximal_logp: torch.Tensor | None = None

    @property
    def proximal(self) -> torch.Tensor:
        """The proximal (PPO anchor) log-probs: the step's starting weights."""
        return self.logp.detach() if self.proximal_logp is None else self.proximal_logp


# (inputs, cfg) -> ((B, T) per-token loss, (B, T) float 1.0 where clipped or capped)
PolicyLoss = Callable[[LossInputs, TrainConfig], tuple[torch.Tensor, torch.Tensor]]
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
def ppo_loss(inputs: LossInputs, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate against the behaviour log-probs (``grpo.clipped_surrogate``; verl's default
    without rollout correction): ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``,
    ``rho = exp(logp - behaviour)``, and with ``train.clip_ratio_c`` the dual clip ``min(loss, -c A)`` for
    ``A < 0``. The proximal log-probs are not used."""
    return grpo.clipped_surrogate(inputs.logp, inputs.behaviour_logp, inputs.advantages, cfg.clip_eps_low,
                                  cfg.clip_eps_high, cfg.clip_ratio_c)


@register_policy_loss("decoupled")
def decoupled_loss(inputs: LossInputs, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's decoupled PPO (``offpolicy.decoupled_ppo_loss``) against the step's starting weights.

    The proximal policy is the weights at the start of the step. With one
    optimiser step per batch (``train.minibatches_per_step = 1``) that is
    ``logp`` detached: the ratio ``r = 1`` (with its gradient) and neither the
    clip nor the dual clip engages; with several, the trainer recomputes the
    proximal log-probs before the first and the clip bounds how far the later
    minibatches move from them. The capped behaviour weight ``w = min(exp(proximal
    - behaviour), is_weight_cap)`` (per token, or per sequence with
    ``train.is_level``; dropped above the cap with ``is_cap_mode = "mask"``)
    corrects stale and replayed tokens. The reported clip fraction is the share
    of tokens where the clip was active or the weight hit the cap.
    """
    proximal = inputs.proximal
    per_token, clipped, _ = offpolicy.decoupled_ppo_loss(
        inputs.logp, proximal, inputs.behaviour_logp, inputs.advantages, cfg.clip_eps_low, cfg.clip_eps_high,
        cfg.is_weight_cap, cfg.is_cap_mode, cfg.clip_ratio_c, level=cfg.is_level, mask=inputs.mask)
    log_ratio = offpolicy.importance_log_ratio(proximal, inputs.behaviour_logp, cfg.is_level, inputs.mask)
    return per_token, torch.maximum(clipped, (log_ratio > math.log(cfg.is_weight_cap)).float())


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
