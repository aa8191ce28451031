import math

import pytest
import torch

from tether.algorithms import CORRECTIONS
from tether.algorithms.corrections import geo_mask, mis_seq, mis_token, no_correction, tis_seq, tis_token
from tether.errors import ConfigError

# Ratios pi_old / pi_behav per token (behaviour log-probs 0, so log ratio = logp_old exactly):
#   row 0: [3.0, 0.5, 2.0]   product 3.0, geometric mean 3^(1/3) = 1.44225
#   row 1: [1.5, 0.8, pad]   product 1.2, geometric mean sqrt(1.2) = 1.09545
RATIOS = torch.tensor([[3.0, 0.5, 2.0], [1.5, 0.8, 1.0]])
LOGP_OLD = RATIOS.log()
LOGP_BEHAV = torch.zeros(2, 3)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_none_keeps_every_valid_token_and_leaves_the_weight_to_the_loss():
    out = no_correction(LOGP_OLD, LOGP_BEHAV, MASK)
    assert out.weights is None  # the policy loss keeps its own weight
    assert torch.equal(out.keep_mask, MASK)


def test_tis_token_truncates_at_cap_and_ratio_at_cap_is_cap():
    out = tis_token(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0)
    # 3.0 -> 2.0; 2.0 (exactly the cap) stays 2.0; padding 0.
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 0.5, 2.0], [1.5, 0.8, 0.0]]))
    assert out.weights[0, 2].item() == 2.0
    assert torch.equal(out.keep_mask, MASK)


def test_tis_seq_truncates_the_product_and_broadcasts_it():
    out = tis_seq(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0)
    # row 0: min(3.0, 2) = 2; row 1: min(1.2, 2) = 1.2 (the padding ratio is not in the product).
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 2.0, 2.0], [1.2, 1.2, 0.0]]))


def test_mis_token_drops_instead_of_truncating_and_keeps_ratio_at_cap():
    out = mis_token(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0)
    assert out.keep_mask.tolist() == [[False, True, True], [True, True, False]]
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.5, 2.0], [1.5, 0.8, 0.0]]))
    # lo=0.6 also drops the 0.5 token.
    out = mis_token(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0, lo=0.6)
    assert out.keep_mask.tolist() == [[False, False, True], [True, True, False]]


def test_mis_seq_drops_whole_sequences():
    out = mis_seq(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0)
    # row 0's product 3.0 > 2: dropped; row 1 keeps w = 1.2 on its valid tokens.
    assert out.keep_mask.tolist() == [[False, False, False], [True, True, False]]
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.0, 0.0], [1.2, 1.2, 0.0]]))
    # lo=1.5 drops row 1 (1.2 < 1.5) and cap=4 keeps row 0 (3 <= 4).
    out = mis_seq(LOGP_OLD, LOGP_BEHAV, MASK, cap=4.0, lo=1.5)
    assert out.keep_mask.tolist() == [[True, True, True], [False, False, False]]


def test_seq_ratio_exactly_at_cap_is_kept():
    logp_old = torch.tensor([[math.log(2.0)]])
    out = mis_seq(logp_old, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), cap=2.0)
    assert out.keep_mask.item() is True


def test_geo_mask_uses_the_per_token_geometric_mean():
    # Geometric means 1.44225 and 1.09545. Band [1/1.5, 1.5] keeps both; [1/1.4, 1.4] drops row 0.
    out = geo_mask(LOGP_OLD, LOGP_BEHAV, MASK, cap=1.5)
    assert torch.equal(out.keep_mask, MASK)
    assert out.weights is None  # a mask only
    out = geo_mask(LOGP_OLD, LOGP_BEHAV, MASK, cap=1.4)
    assert out.keep_mask.tolist() == [[False, False, False], [True, True, False]]
    # An explicit lo above 1.09545 drops row 1 instead.
    out = geo_mask(LOGP_OLD, LOGP_BEHAV, MASK, cap=1.5, lo=1.1)
    assert out.keep_mask.tolist() == [[True, True, True], [False, False, False]]


@pytest.mark.parametrize("name", ["none", "tis_token", "tis_seq", "mis_token", "mis_seq", "geo_mask"])
def test_weights_are_detached_zero_outside_keep_and_keep_is_within_mask(name):
    logp_old = LOGP_OLD.clone().requires_grad_()
    out = CORRECTIONS.get(name)(logp_old, LOGP_BEHAV, MASK, cap=2.0)
    assert not (out.keep_mask & ~MASK).any()
    if name in ("none", "geo_mask"):  # masks only: the policy loss keeps its own weight
        assert out.weights is None
        return
    assert not out.weights.requires_grad
    assert (out.weights[~out.keep_mask] == 0).all()
    assert out.weights.shape == MASK.shape


def test_huge_log_ratio_does_not_overflow_into_inf_or_nan():
    logp_old = torch.tensor([[60.0, 60.0]])  # sequence log ratio 120: exp overflows fp32
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert tis_seq(logp_old, torch.zeros(1, 2), mask, cap=2.0).weights.tolist() == [[2.0, 2.0]]
    dropped = mis_seq(logp_old, torch.zeros(1, 2), mask, cap=2.0)
    assert dropped.weights.tolist() == [[0.0, 0.0]] and not dropped.keep_mask.any()


def test_bad_thresholds_are_config_errors():
    with pytest.raises(ConfigError, match="cap must be > 0"):
        tis_token(LOGP_OLD, LOGP_BEHAV, MASK, cap=0.0)
    with pytest.raises(ConfigError, match="lo must be in"):
        mis_token(LOGP_OLD, LOGP_BEHAV, MASK, cap=2.0, lo=3.0)
