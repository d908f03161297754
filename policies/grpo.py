"""GRPO as pure functions: tensors in, tensors out.

How this differs from the GRPO paper (Shao et al., 2024, arXiv 2402.03300):

1. The KL term is optional (``kl_coef=0`` by default, as in DAPO and most
   verifiable-reward recipes); when on it is the k3 estimator added to the loss.
2. The ratio clip is asymmetric (``eps_low``, ``eps_high``; DAPO's clip-higher).
3. The loss is averaged over all response tokens of the batch
   (``token_mean``, DAPO) rather than per sequence first; ``seq_mean`` is offered.
4. Each sample may carry a loss weight (1.0 for fresh on-policy data); later
   modes use it to down-weight stale or replayed samples.

Shapes: ``B`` samples, ``T`` response tokens (right-padded), ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6,
                     scale_by_std: bool = True, unbiased_std: bool = False) -> torch.Tensor:
    """Group-normalised advantages.

    ``A_i = (r_i - mean_{g(i)}) / (std_{g(i)} + eps)`` where the mean and the
    standard deviation run over the samples of ``i``'s group: the population
    one, ``sqrt(sum (r - mean)^2 / n)``, or with ``unbiased_std`` the sample
    one, ``sqrt(sum (r - mean)^2 / (n - 1))`` (what verl's GRPO uses, through
    ``torch.std``). The two differ by the factor ``sqrt((n - 1) / n)`` in the
    std, so unbiased advantages are ``sqrt((n - 1) / n)`` times the population
    ones (0.935 for groups of 8). A group whose rewards are all equal gets zero
    advantages; ``scale_by_std=False`` only centres.

    Args:
        rewards: (B,) float rewards.
        group_index: (B,) long, dense group ids in ``[0, G)``.
    Returns:
        (B,) float advantages.
    """
    groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    ones = torch.ones_like(rewards)
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, ones)
    total = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = total / count
    # Exactly 0 for a group of equal rewards (the summed mean of e.g. eight 0.1s is not exactly 0.1), so the
    # trainer can tell that such samples carry no gradient.
    lowest = torch.full((groups,), float("inf"), dtype=rewards.dtype).scatter_reduce(0, group_index, rewards, "amin")
    highest = torch.full((groups,), float("-inf"), dtype=rewards.dtype).scatter_reduce(0, group_index, rewards,
                                                                                        "amax")
    flat = (lowest == highest)[group_index]
    centred = torch.where(flat, torch.zeros_like(rewards), rewards - mean[group_index])
    if not scale_by_std:
        return centred
    sq = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2)
    dof = (count - 1).clamp(min=1) if unbiased_std else count  # a group of one is flat: its advantage is 0
    std = torch.sqrt(sq / dof)
    return centred / (std[group_index] + eps)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token.

    Args:
        logits: (B, T, V) logits that predict ``tokens`` (already shifted).
        tokens: (B, T) long.
    Returns:
        (B, T) float log pi(token).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution, ``-sum_v p_v log p_v``.

    Args:
        logits: (B, T, V).
    Returns:
        (B, T) float entropy in nats.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def clipped_surrogate(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float, clip_ratio_c: float | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO clipped surrogate loss (to minimise).

    ``rho_t = exp(logp_t - behaviour_logp_t)``;
    ``loss_t = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)``.

    Dual clip (``clip_ratio_c = c > 1``; Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep Reinforcement Learning", arXiv
    1912.09729): for a negative advantage the objective is also bounded
    below by ``c * A``, so ``loss_t = min(loss_t, -c * A)`` where ``A < 0``.
    Without it a token whose ratio has grown far above 1 under a negative
    advantage contributes ``-rho * A``, unbounded. ``None``: no dual clip.

    Args:
        logp: (B, T) current policy log-probs (carries the gradient).
        behaviour_logp: (B, T) log-probs of the policy that sampled the tokens.
        advantages: (B,) per-sample advantages, broadcast over tokens.
    Returns:
        ((B, T) per-token loss, (B, T) float 1.0 where a clip (or the dual clip) was active).
    """
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clip_active = clipped < unclipped
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv  # > 0 where A < 0
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        clip_active = clip_active | dual
    return loss, clip_active.float()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman, 2020).

    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (non-negative, unbiased).

    Args:
        logp, ref_logp: (B, T).
    Returns:
        (B, T).
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, sample_weight: torch.Tensor,
              mode: Literal["token_mean", "seq_mean"], normaliser: float) -> torch.Tensor:
    """Reduce a per-token quantity to the scalar loss of one micro-batch.

    ``token_mean``: ``sum_{i,t} w_i m_it x_it / normaliser`` where the
    normaliser is the number of loss tokens in the whole batch (so micro-batches
    add up to the batch mean). ``seq_mean``: ``sum_i w_i mean_t(m_i x_i) /
    normaliser`` with the normaliser the number of samples in the batch.

    Args:
        per_token: (B, T). mask: (B, T) 0/1. sample_weight: (B,).
    Returns:
        scalar tensor.
    """
    masked = per_token * mask
    if mode == "token_mean":
        return (masked.sum(-1) * sample_weight).sum() / normaliser
    lengths = mask.sum(-1).clamp(min=1.0)
    return ((masked.sum(-1) / lengths) * sample_weight).sum() / normaliser
