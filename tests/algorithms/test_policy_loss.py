import math

import pytest
import torch

from tether.algorithms import POLICY_LOSSES
from tether.algorithms.policy_loss import approx_proximal_logprobs, decoupled_ppo, ppo_clip


def _ratios_as_logp(ratios):
    """Current log-probs whose ratio to logp_old = 0 is ``ratios``, as a leaf that takes gradients."""
    return torch.tensor(ratios).log().requires_grad_()


def test_ppo_clip_hand_computed_loss_stats_and_gradient():
    # r = [1.5, 0.5, 1.1, 3.0], A = [1, -1, -1, 2], eps 0.2, last token masked:
    #   t0: min(1.5 * 1, 1.2 * 1) = 1.2        -> loss -1.2, clipped (no gradient)
    #   t1: min(0.5 * -1, 0.8 * -1) = -0.8     -> loss  0.8, clipped (no gradient)
    #   t2: min(1.1 * -1, 1.1 * -1) = -1.1     -> loss  1.1, inside the band: d loss / d logp = -r A = 1.1
    #   t3: masked                             -> loss  0
    logp = _ratios_as_logp([[1.5, 0.5, 1.1, 3.0]])
    logp_old = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = ppo_clip(logp, logp_old, advantages, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8, 1.1, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.1, 0.0]]))
    torch.testing.assert_close(stats.clip_frac, torch.tensor(2 / 3))
    torch.testing.assert_close(stats.ratio_mean, torch.tensor((1.5 + 0.5 + 1.1) / 3))
    # k3: mean(r - 1 - ln r) = (0.094535 + 0.193147 + 0.004690) / 3
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    torch.testing.assert_close(stats.approx_kl, torch.tensor(expected_kl))
    torch.testing.assert_close(stats.behav_weight_mean, torch.tensor(1.0))


def test_clip_boundaries_and_asymmetric_clip_high():
    # clip_low=0.2, clip_high=0.28 (DAPO): A > 0 clips above 1.28, A < 0 clips below 0.8.
    logp = _ratios_as_logp([[1.2799, 1.2801, 0.8001, 0.7999]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = ppo_clip(logp, torch.zeros(1, 4), advantages, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.2799, -1.28, 0.8001, 0.8]]))
    loss.sum().backward()
    # Inside the band the gradient is -r A; at the clipped side it is 0.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2799, 0.0, 0.8001, 0.0]]))
    torch.testing.assert_close(stats.clip_frac, torch.tensor(0.5))


def test_clip_never_helps_the_pessimistic_side():
    # A > 0 with r < 1 - eps, A < 0 with r > 1 + eps: the min keeps the unclipped (worse) term.
    logp = _ratios_as_logp([[0.5, 1.5]])
    loss, stats = ppo_clip(
        logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    )
    torch.testing.assert_close(loss, torch.tensor([[-0.5, 1.5]]))
    assert stats.clip_frac.item() == 0.0


def test_sequence_advantages_broadcast_and_is_weights_multiply():
    logp = torch.tensor([[0.1, -0.1], [0.05, 0.0]])
    logp_old = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    per_seq, _ = ppo_clip(logp, logp_old, torch.tensor([1.0, -2.0]), mask)
    per_token, _ = ppo_clip(logp, logp_old, torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), mask)
    torch.testing.assert_close(per_seq, per_token)
    weights = torch.tensor([[2.0, 0.5], [1.0, 0.0]])
    weighted, stats = ppo_clip(logp, logp_old, torch.tensor([1.0, -2.0]), mask, is_weights=weights)
    torch.testing.assert_close(weighted, per_token * weights)
    torch.testing.assert_close(stats.behav_weight_mean, torch.tensor(3.5 / 4))


def test_masked_padding_with_minus_inf_logprobs_contributes_nothing_and_no_nan():
    logp = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    logp_old = torch.tensor([[-0.5, float("-inf")]])
    mask = torch.tensor([[True, False]])
    for name in POLICY_LOSSES.names():
        loss, stats = POLICY_LOSSES.get(name)(
            logp, logp_old, torch.tensor([1.0]), mask, logp_behav=torch.tensor([[-0.5, float("-inf")]])
        )
        assert loss[0, 1].item() == 0.0
        loss.sum().backward()
        assert torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(value) for value in (stats.clip_frac, stats.approx_kl, stats.ratio_mean))
        logp.grad = None


def test_a_valid_token_outside_the_top_k_set_of_the_policy_adds_nothing_and_no_nan():
    """A stale token (or one at a near-tie) the trainer's top-k/top-p set no longer holds: -inf under
    the proximal and the current policy, finite under the engine that sampled it. -inf - -inf was a
    NaN loss, and one step turned every weight NaN."""
    for logp_old_value in (float("-inf"), -1.0):  # outside both policies' sets, or the current one's only
        logp = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
        logp_old = torch.tensor([[-0.5, logp_old_value]])
        mask = torch.tensor([[True, True]])
        for name in POLICY_LOSSES.names():
            loss, stats = POLICY_LOSSES.get(name)(
                logp, logp_old, torch.tensor([1.0]), mask, logp_behav=torch.tensor([[-0.5, -2.0]])
            )
            assert loss[0, 1].item() == 0.0 and torch.isfinite(loss).all()
            loss.sum().backward()
            assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0
            assert all(torch.isfinite(value) for value in (stats.clip_frac, stats.approx_kl, stats.ratio_mean))
            logp.grad = None


def test_decoupled_ppo_with_prox_equal_behav_is_ppo_clip():
    generator = torch.Generator().manual_seed(0)
    logp_behav = -torch.rand(3, 5, generator=generator)
    logp = (logp_behav + 0.3 * torch.randn(3, 5, generator=generator)).requires_grad_()
    advantages = torch.randn(3, generator=generator)
    mask = torch.rand(3, 5, generator=generator) > 0.2
    plain, plain_stats = ppo_clip(logp, logp_behav, advantages, mask)
    (plain_grad,) = torch.autograd.grad(plain.sum(), logp)
    decoupled, decoupled_stats = decoupled_ppo(logp, logp_behav, advantages, mask, logp_behav=logp_behav)
    (decoupled_grad,) = torch.autograd.grad(decoupled.sum(), logp)
    torch.testing.assert_close(decoupled, plain)
    torch.testing.assert_close(decoupled_grad, plain_grad)
    torch.testing.assert_close(decoupled_stats.clip_frac, plain_stats.clip_frac)


def test_decoupled_ppo_hand_computed_behaviour_weight():
    # pi_behav = 0.25, pi_prox = 0.5 -> weight 2 (detached); r = pi / pi_prox = 1.1 with A = 1
    # -> loss -2 * 1.1 = -2.2 and d loss / d logp = -2 * 1.1 = -2.2 (none through the weight).
    logp_prox = torch.tensor([[math.log(0.5)]], requires_grad=True)
    logp_behav = torch.tensor([[math.log(0.25)]])
    logp = torch.tensor([[math.log(0.55)]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = decoupled_ppo(logp, logp_prox, torch.tensor([1.0]), mask, logp_behav=logp_behav)
    torch.testing.assert_close(loss, torch.tensor([[-2.2]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.2]]))
    assert logp_prox.grad is None or torch.all(logp_prox.grad == 0)
    torch.testing.assert_close(stats.behav_weight_mean, torch.tensor(2.0))
    torch.testing.assert_close(stats.ratio_mean, torch.tensor(1.1))


def test_decoupled_ppo_is_ppo_clip_with_the_behaviour_weight_as_is_weights():
    generator = torch.Generator().manual_seed(1)
    logp_behav = -torch.rand(2, 4, generator=generator)
    logp_prox = logp_behav + 0.2 * torch.randn(2, 4, generator=generator)
    logp = logp_prox + 0.2 * torch.randn(2, 4, generator=generator)
    advantages = torch.randn(2, 4, generator=generator)
    mask = torch.ones(2, 4, dtype=torch.bool)
    decoupled, _ = decoupled_ppo(logp, logp_prox, advantages, mask, logp_behav=logp_behav)
    weights = (logp_prox - logp_behav).exp()
    plain, _ = ppo_clip(logp, logp_prox, advantages, mask, is_weights=weights)
    torch.testing.assert_close(decoupled, plain)
    # Given is_weights (e.g. truncated by a correction) replace the raw weight.
    capped, _ = decoupled_ppo(
        logp, logp_prox, advantages, mask, logp_behav=logp_behav, is_weights=weights.clamp(max=1)
    )
    torch.testing.assert_close(
        capped, ppo_clip(logp, logp_prox, advantages, mask, is_weights=weights.clamp(max=1))[0]
    )


def test_decoupled_ppo_requires_behaviour_logprobs():
    with pytest.raises(ValueError, match="logp_behav"):
        decoupled_ppo(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool))


def test_approx_proximal_logprobs_hand_computed():
    # Row 0: v_behav 0, v_prox 3, v_cur 4 -> alpha 3/4: -1 + 0.75 * (-3 - -1) = -2.5.
    # Row 1: v_behav 2 -> alpha (3 - 2) / (4 - 2) = 1/2: -2 + 0.5 * (-4 - -2) = -3.
    # Row 2: v_behav 4 = v_cur (on-policy) -> alpha 0: the behaviour log-prob.
    logp_behav = torch.tensor([[-1.0], [-2.0], [-0.5]])
    logp_current = torch.tensor([[-3.0], [-4.0], [-0.7]], requires_grad=True)
    out = approx_proximal_logprobs(logp_behav, logp_current, torch.tensor([0, 2, 4]), 3, 4)
    torch.testing.assert_close(out, torch.tensor([[-2.5], [-3.0], [-0.5]]))
    assert not out.requires_grad


def test_approx_proximal_logprobs_per_token_versions_and_padding():
    # Tokens of one sequence sampled across a weight update: versions 1 and 3, prox 3, current 5.
    # t0: alpha (3 - 1) / (5 - 1) = 0.5 -> -1 + 0.5 * (-2 + 1) = -1.5; t1: alpha 0 -> -1; t2 padding.
    logp_behav = torch.tensor([[-1.0, -1.0, float("-inf")]])
    logp_current = torch.tensor([[-2.0, -3.0, float("-inf")]])
    out = approx_proximal_logprobs(logp_behav, logp_current, torch.tensor([[1, 3, 0]]), 3, 5)
    assert out[0, :2].tolist() == [-1.5, -1.0]
    assert not torch.isnan(out).any()
