import math

import pytest
import torch

from reflow.policies import grpo, offpolicy


def _log(*values: float) -> torch.Tensor:
    return torch.log(torch.tensor([list(values)]))


def test_decoupled_loss_on_policy_is_the_plain_clipped_surrogate() -> None:
    logp = _log(1.5, 0.5, 1.0, 0.9)
    proximal = behaviour = torch.zeros(1, 4)
    adv = torch.tensor([2.0])
    loss, clipped, weight = offpolicy.decoupled_ppo_loss(logp, proximal, behaviour, adv, 0.2, 0.28, 3.0)
    plain, plain_clipped = grpo.clipped_surrogate(logp, behaviour, adv, 0.2, 0.28)
    assert torch.equal(loss, plain) and torch.equal(clipped, plain_clipped)
    assert weight.tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_decoupled_loss_hand_computed() -> None:
    # proximal 0, behaviour ln(.5, 1, .25) -> w = exp(prox - behav) = 2, 1, 4 -> capped at 3: 2, 1, 3
    # r = exp(logp - prox) = 1.5, .5, 1 ; A = 2, eps .2/.28
    #   r=1.5: min(3, 1.28*2) = 2.56 -> -2.56 * 2 = -5.12 (clip active)
    #   r=.5:  min(1, .8*2)  = 1    -> -1 * 1    = -1
    #   r=1:   2                    -> -2 * 3    = -6
    logp, proximal, behaviour = _log(1.5, 0.5, 1.0), torch.zeros(1, 3), _log(0.5, 1.0, 0.25)
    loss, clipped, weight = offpolicy.decoupled_ppo_loss(logp, proximal, behaviour, torch.tensor([2.0]),
                                                         0.2, 0.28, max_is_weight=3.0)
    assert torch.allclose(weight, torch.tensor([[2.0, 1.0, 3.0]]))
    assert torch.allclose(loss, torch.tensor([[-5.12, -1.0, -6.0]]), atol=1e-6)
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    # AReaL's code drops the token above the cap instead of truncating it
    masked, _, mask_weight = offpolicy.decoupled_ppo_loss(logp, proximal, behaviour, torch.tensor([2.0]),
                                                          0.2, 0.28, 3.0, cap_mode="mask")
    assert torch.allclose(mask_weight, torch.tensor([[2.0, 1.0, 0.0]]))
    assert torch.allclose(masked, torch.tensor([[-5.12, -1.0, 0.0]]), atol=1e-6)


def test_decoupled_loss_clips_against_proximal_not_behaviour() -> None:
    # logp = prox = ln 1.5, behaviour 0: r vs proximal is 1 (no clip); w = 1.5 -> loss -1.5 * 1 * A(=1)
    logp = proximal = _log(1.5)
    loss, clipped, _ = offpolicy.decoupled_ppo_loss(logp, proximal, torch.zeros(1, 1), torch.tensor([1.0]),
                                                    0.2, 0.2, 10.0)
    assert torch.allclose(loss, torch.tensor([[-1.5]])) and clipped.tolist() == [[0.0]]


def test_decoupled_weights_carry_no_gradient() -> None:
    # w = exp(0 - ln(.5, 2)) = 2, .5 ; at logp = prox, r = 1: dloss/dlogp = -w * A * r = -6, -1.5 (A = 3)
    logp = torch.zeros(1, 2, requires_grad=True)
    proximal = torch.zeros(1, 2, requires_grad=True)
    behaviour = _log(0.5, 2.0).requires_grad_(True)
    loss, _, weight = offpolicy.decoupled_ppo_loss(logp, proximal, behaviour, torch.tensor([3.0]), 0.2, 0.2, 5.0)
    assert not weight.requires_grad
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-6.0, -1.5]]))
    assert proximal.grad is None and behaviour.grad is None


def test_truncated_is_weights_cap_and_no_gradient() -> None:
    # exp(0 - ln(.25, 1, 4)) = 4, 1, .25 -> capped at C = 2: 2, 1, .25
    old = torch.zeros(1, 3, requires_grad=True)
    weight = offpolicy.truncated_is_weights(old, _log(0.25, 1.0, 4.0), cap=2.0)
    assert torch.allclose(weight, torch.tensor([[2.0, 1.0, 0.25]])) and not weight.requires_grad
    with pytest.raises(ValueError, match="cap"):
        offpolicy.truncated_is_weights(old, old, cap=0.0)


def test_tis_loss_on_policy_and_hand_computed() -> None:
    logp, adv = _log(1.5, 0.5), torch.tensor([-1.0])
    loss, clipped, weight = offpolicy.tis_policy_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), adv, 0.2, 0.28, 2.0)
    plain, plain_clipped = grpo.clipped_surrogate(logp, torch.zeros(1, 2), adv, 0.2, 0.28)
    assert torch.equal(loss, plain) and torch.equal(clipped, plain_clipped) and weight.tolist() == [[1.0, 1.0]]
    # behaviour ln(2, .5) -> w = .5, 2 -> capped at 1.5: .5, 1.5 ; r = 1.5, .5 ; A = -1
    #   r=1.5: min(-1.5, -1.28) = -1.5 -> 1.5 * .5 = .75 (no clip)
    #   r=.5:  min(-.5, -.8)    = -.8  ->  .8 * 1.5 = 1.2 (clip active)
    loss, clipped, weight = offpolicy.tis_policy_loss(logp, torch.zeros(1, 2), _log(2.0, 0.5), adv, 0.2, 0.28, 1.5)
    assert torch.allclose(weight, torch.tensor([[0.5, 1.5]]))
    assert torch.allclose(loss, torch.tensor([[0.75, 1.2]]), atol=1e-6) and clipped.tolist() == [[0.0, 1.0]]


def test_sequence_and_geometric_weights_hand_computed() -> None:
    # token log-ratios ln 2, ln 4, ln 8 on the first two tokens only (mask 1, 1, 0); second row all masked
    anchor = torch.zeros(2, 3)
    behaviour = torch.stack([_log(0.5, 0.25, 0.125)[0], _log(0.5, 0.5, 0.5)[0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    token = offpolicy.capped_is_weights(anchor, behaviour, 100.0)
    assert torch.allclose(token, torch.tensor([[2.0, 4.0, 8.0], [2.0, 2.0, 2.0]]))
    # sequence: exp(ln 2 + ln 4) = 8 on every token of the row; an all-masked row: exp(0) = 1
    sequence = offpolicy.capped_is_weights(anchor, behaviour, 100.0, level="sequence", mask=mask)
    assert torch.allclose(sequence, torch.tensor([[8.0] * 3, [1.0] * 3]))
    # geometric: exp((ln 2 + ln 4) / 2) = sqrt(8)
    geometric = offpolicy.capped_is_weights(anchor, behaviour, 100.0, level="geometric", mask=mask)
    assert torch.allclose(geometric, torch.tensor([[math.sqrt(8.0)] * 3, [1.0] * 3]))
    # cap 5: truncate -> 5; mask (MIS) -> the whole sequence dropped
    assert torch.allclose(offpolicy.capped_is_weights(anchor, behaviour, 5.0, "truncate", "sequence", mask),
                          torch.tensor([[5.0] * 3, [1.0] * 3]))
    assert torch.allclose(offpolicy.capped_is_weights(anchor, behaviour, 5.0, "mask", "sequence", mask),
                          torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_sequence_weights_of_long_sequences_do_not_overflow() -> None:
    # 2,000 tokens at log-ratio 1 each: exp(2000) is inf in float32; the cap is applied in log space
    anchor, behaviour, mask = torch.ones(1, 2000), torch.zeros(1, 2000), torch.ones(1, 2000)
    assert offpolicy.capped_is_weights(anchor, behaviour, 2.0, "truncate", "sequence", mask).unique().tolist() == [
        pytest.approx(2.0)]
    assert offpolicy.capped_is_weights(anchor, behaviour, 2.0, "mask", "sequence", mask).unique().tolist() == [0.0]


def test_sequence_levels_need_the_mask_and_known_names() -> None:
    with pytest.raises(ValueError, match="need the loss mask"):
        offpolicy.capped_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), 2.0, level="sequence")
    with pytest.raises(ValueError, match="'token', 'sequence' or 'geometric'"):
        offpolicy.capped_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), 2.0, level="word", mask=torch.ones(1, 2))
