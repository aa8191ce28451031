import math

import pytest
import torch

from tether.algorithms import ADVANTAGES
from tether.algorithms.advantages import dr_grpo, grpo, reinforce_pp, reinforce_pp_baseline, rloo
from tether.errors import ConfigError

# Two groups of G=4: [1, 0, 0, 0] and [1, 1, 0, 0].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


def test_grpo_hand_computed_with_unbiased_std():
    # Group 1: mean 0.25; deviations 0.75, -0.25 x3; unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25,
    # std 0.5 -> [1.5, -0.5, -0.5, -0.5].
    # Group 2: mean 0.5; deviations +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735 -> +-0.866025.
    s = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, s, s, -s, -s])
    torch.testing.assert_close(grpo(REWARDS, 4), expected, rtol=1e-5, atol=1e-5)


def test_grpo_eps_is_added_to_std():
    # Group [2, 0]: mean 1, unbiased std sqrt(2) -> +-1 / (sqrt(2) + eps).
    out = grpo(torch.tensor([2.0, 0.0]), 2, eps=0.5)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0]) / (math.sqrt(2) + 0.5))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_all_equal_rewards_give_exactly_zero_not_nan(name):
    # 0.1 and 0.3 are not exact in binary: r - mean would leave rounding noise that 1 / eps amplifies.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3])
    out = ADVANTAGES.get(name)(rewards, 3)
    assert torch.equal(out, torch.zeros(6))


def test_constant_group_is_zero_while_other_groups_are_not():
    out = grpo(torch.tensor([0.7, 0.7, 1.0, 0.0]), 2)
    assert torch.equal(out[:2], torch.zeros(2))
    # [1, 0]: mean 0.5, deviations +-0.5, unbiased std sqrt(0.5 / 1) -> +-0.5 / 0.70711 = +-0.70711.
    torch.testing.assert_close(out[2:], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))


def test_dr_grpo_is_grpo_without_std():
    # Group 1 mean 0.25, group 2 mean 0.5.
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(dr_grpo(REWARDS, 4), expected)
    torch.testing.assert_close(grpo(REWARDS, 4, scale_by_std=False), expected)


def test_rloo_leave_one_out_baseline():
    # Group 1: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    # Group 2: 1 - mean(1, 0, 0) = 2/3; 0 - mean(1, 1, 0) = -2/3.
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3])
    torch.testing.assert_close(rloo(REWARDS, 4), expected)


def test_reinforce_pp_whitens_over_the_batch():
    # Batch mean 3/8; deviations 5/8 (x3) and -3/8 (x5); unbiased var = (3 * 25 + 5 * 9) / 64 / 7
    # = 1.875 / 7; std 0.517549.
    std = math.sqrt(1.875 / 7)
    expected = torch.where(REWARDS > 0, 0.625, -0.375) / (std + 1e-6)
    torch.testing.assert_close(reinforce_pp(REWARDS, 4), expected)


def test_reinforce_pp_constant_batch_is_zero_but_constant_groups_are_not():
    assert torch.equal(reinforce_pp(torch.full((6,), 0.1), 3), torch.zeros(6))
    # No group baseline: the low group is below the batch mean, the high one above.
    out = reinforce_pp(torch.tensor([0.1, 0.1, 0.3, 0.3]), 2)
    assert (out[:2] < 0).all() and (out[2:] > 0).all()


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    # Group-centred: [0.75, -0.25 x3, 0.5, 0.5, -0.5, -0.5]; its mean is 0 and unbiased var
    # = (0.5625 + 3 * 0.0625 + 4 * 0.25) / 7 = 0.25, std 0.5.
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(reinforce_pp_baseline(REWARDS, 4), centred / (0.5 + 1e-6))


def _masked_whiten(values, mask):
    """verl's ``masked_whiten`` (unbiased variance) of token-level advantages under the response mask."""
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-12)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_normalises_over_tokens_as_verl(name):
    """Long correct answers, short wrong ones: a sequence weighs as many tokens as it has, so the
    advantages equal verl's whitening of the per-token advantages (not one value per sequence)."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # 3 groups of 2
    lengths = torch.tensor([10, 10, 1, 1, 10, 0])  # the last completion is empty: it weighs nothing
    mask = (torch.arange(10)[None] < lengths[:, None]).float()  # [B, T]
    per_sequence = rewards.view(-1, 2) - rewards.view(-1, 2).mean(1, keepdim=True) if name.endswith(
        "baseline") else rewards.view(-1, 2)
    expected = _masked_whiten(per_sequence.reshape(-1, 1) * mask, mask)[:, 0]
    out = ADVANTAGES.get(name)(rewards, 2, lengths=lengths, eps=0.0)
    torch.testing.assert_close(out[:5], expected[:5])
    # One token each: the per-sequence whitening.
    torch.testing.assert_close(ADVANTAGES.get(name)(rewards, 2, lengths=torch.ones(6, dtype=torch.long)),
                               ADVANTAGES.get(name)(rewards, 2))


def test_group_size_one_is_a_config_error_where_a_baseline_needs_peers():
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        grpo(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        rloo(torch.tensor([1.0, 0.0]), 1)


def test_batch_not_a_multiple_of_group_size_is_rejected():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        grpo(torch.ones(6), 4)


def test_output_is_fp32_for_integer_rewards():
    out = dr_grpo(torch.tensor([1, 0, 1, 1]), 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0, 0.0]))
