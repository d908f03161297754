import math

import pytest
import torch

from reflow.policies import grpo


def test_group_advantages_hand_computed() -> None:
    # group 0: rewards 1, 0 -> mean .5, std .5 -> +1, -1
    # group 1: rewards 1, 1, 1 -> all zero
    # group 2: rewards 0, 0, 3 -> mean 1, std sqrt(2) -> -1/sqrt2, -1/sqrt2, 2/sqrt2
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    adv = grpo.group_advantages(rewards, groups, eps=0.0 + 1e-12)
    s2 = math.sqrt(2)
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, -1 / s2, -1 / s2, 2 / s2])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_group_advantages_without_std_scaling() -> None:
    adv = grpo.group_advantages(torch.tensor([2.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), scale_by_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0]


def test_group_advantages_are_exactly_zero_for_equal_rewards() -> None:
    # eight 0.1s sum to 0.7999999999999999 in float64, so the summed mean is not exactly 0.1
    rewards = torch.tensor([0.1] * 8 + [0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0] * 8 + [1, 1])
    adv = grpo.group_advantages(rewards, groups)
    assert adv[:8].tolist() == [0.0] * 8
    assert adv[8:].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)


def test_token_logprobs_and_entropy_uniform() -> None:
    logits = torch.zeros(1, 2, 4)
    tokens = torch.tensor([[0, 3]])
    assert torch.allclose(grpo.token_logprobs(logits, tokens), torch.full((1, 2), -math.log(4)))
    assert torch.allclose(grpo.entropy_from_logits(logits), torch.full((1, 2), math.log(4)))


def test_clipped_surrogate_hand_computed() -> None:
    # ratios: e^0 = 1, e^ln1.5 = 1.5, e^ln0.5 = 0.5 ; eps_low .2, eps_high .28
    behaviour = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))
    adv = torch.tensor([2.0, -1.0])
    loss, clipped = grpo.clipped_surrogate(logp, behaviour, adv, eps_low=0.2, eps_high=0.28)
    # A=+2: min(r*2, clip(r)*2): r=1 -> 2; r=1.5 -> min(3, 2.56)=2.56; r=.5 -> min(1, 1.6)=1
    # A=-1: min(-r, -clip(r)): r=1 -> -1; r=1.5 -> min(-1.5,-1.28)=-1.5; r=.5 -> min(-.5,-.8)=-.8
    expected = -torch.tensor([[2.0, 2.56, 1.0], [-1.0, -1.5, -0.8]])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


def test_clipped_surrogate_gradient_is_policy_gradient_on_policy() -> None:
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    loss, _ = grpo.clipped_surrogate(logp, logp.detach(), torch.tensor([3.0]), 0.2, 0.2)
    loss.sum().backward()
    # d/dlogp of -exp(logp - b) * A at logp=b is -A
    assert torch.allclose(logp.grad, torch.tensor([[-3.0, -3.0]]))


def test_kl_k3_hand_computed() -> None:
    logp = torch.tensor([[0.0, math.log(0.5)]])
    ref = torch.tensor([[0.0, 0.0]])
    # second: delta = ln2 -> 2 - ln2 - 1
    assert torch.allclose(grpo.kl_k3(logp, ref), torch.tensor([[0.0, 1.0 - math.log(2)]]))


@pytest.mark.parametrize("mode,expected", [
    # token_mean: (1*(1+2) + 0.5*4) / 4 loss tokens in the whole batch (other micro-batches hold 1) = 5/4
    ("token_mean", 5.0 / 4.0),
    # seq_mean: (1*1.5 + 0.5*4) / 2 samples = 1.75
    ("seq_mean", 1.75),
])
def test_aggregate_hand_computed(mode: str, expected: float) -> None:
    per_token = torch.tensor([[1.0, 2.0, 9.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weight = torch.tensor([1.0, 0.5])
    normaliser = 4.0 if mode == "token_mean" else 2.0
    out = grpo.aggregate(per_token, mask, weight, mode, normaliser)
    assert out.item() == pytest.approx(expected)


def test_unbiased_std_divides_by_n_minus_1_as_verl_does() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 0])
    # mean 0.5, centred +-0.5, sum of squares 1.0: population std sqrt(1/4) = 0.5, sample std sqrt(1/3) = 0.57735
    population = grpo.group_advantages(rewards, groups)
    unbiased = grpo.group_advantages(rewards, groups, unbiased_std=True)
    assert population.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    assert unbiased.tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], rel=1e-5)
    assert (unbiased / population).tolist() == pytest.approx([(3 / 4) ** 0.5] * 4, rel=1e-5)  # sqrt((n-1)/n)
    # a group of one sample is flat: 0, not a division by n - 1 = 0
    assert grpo.group_advantages(torch.tensor([1.0]), torch.tensor([0]), unbiased_std=True).tolist() == [0.0]


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_only() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.1, 0.1, 0.1]]))  # ratios 5, 2, 5
    eps = (0.2, 0.28)
    # A = -1: loss = -min(-rho, -clip(rho)) = rho (5 and 2); dual clip at c = 3 caps 5 at 3, leaves 2
    negative = torch.tensor([-1.0])
    plain, _ = grpo.clipped_surrogate(logp[:, :2], behaviour[:, :2], negative, *eps)
    dual, active = grpo.clipped_surrogate(logp[:, :2], behaviour[:, :2], negative, *eps, clip_ratio_c=3.0)
    assert plain[0].tolist() == pytest.approx([5.0, 2.0], rel=1e-5)
    assert dual[0].tolist() == pytest.approx([3.0, 2.0], rel=1e-5) and active[0].tolist() == [1.0, 0.0]
    # A = +1: the PPO clip at 1 + eps_high = 1.28 already bounds it; the dual clip changes nothing
    positive = torch.tensor([1.0])
    with_c, _ = grpo.clipped_surrogate(logp[:, 2:], behaviour[:, 2:], positive, *eps, clip_ratio_c=3.0)
    without, _ = grpo.clipped_surrogate(logp[:, 2:], behaviour[:, 2:], positive, *eps)
    assert with_c.tolist() == without.tolist() and with_c[0, 0].item() == pytest.approx(-1.28)
