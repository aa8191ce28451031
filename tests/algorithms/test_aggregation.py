import torch

from tether.algorithms import AGGREGATIONS
from tether.algorithms.aggregation import seq_mean_token_mean, seq_mean_token_sum_norm, token_mean

NAN = float("nan")
# Row 0: three valid tokens 1, 2, 3; row 1: one valid token 4, then padding holding NaN.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_token_mean_hand_computed():
    # (1 + 2 + 3 + 4) / 4 tokens
    torch.testing.assert_close(token_mean(LOSS, MASK), torch.tensor(2.5))


def test_seq_mean_token_mean_hand_computed():
    # mean(1, 2, 3) = 2, mean(4) = 4 -> (2 + 4) / 2
    torch.testing.assert_close(seq_mean_token_mean(LOSS, MASK), torch.tensor(3.0))


def test_seq_mean_token_sum_norm_hand_computed():
    # max_len defaults to T = 3: (6 / 3 + 4 / 3) / 2 = 5 / 3; with max_len=4: (6 / 4 + 4 / 4) / 2 = 1.25.
    torch.testing.assert_close(seq_mean_token_sum_norm(LOSS, MASK), torch.tensor(5 / 3))
    torch.testing.assert_close(seq_mean_token_sum_norm(LOSS, MASK, max_len=4), torch.tensor(1.25))


def test_masked_nan_never_leaks_into_value_or_gradient():
    for name in AGGREGATIONS.names():
        loss = LOSS.clone().requires_grad_()
        out = AGGREGATIONS.get(name)(loss, MASK)
        assert torch.isfinite(out)
        out.backward()
        assert torch.isfinite(loss.grad).all()
        assert (loss.grad[~MASK] == 0).all()


def test_sequence_without_tokens_is_left_out_of_the_sequence_mean():
    loss = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[True, True], [False, False]])
    torch.testing.assert_close(seq_mean_token_mean(loss, mask), torch.tensor(3.0))
    torch.testing.assert_close(
        token_mean(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool)), torch.tensor(0.0)
    )


def test_global_normalizer_makes_micro_batches_add_up_to_the_full_batch():
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 6, generator=generator)
    mask = torch.rand(4, 6, generator=generator) > 0.3
    mask[:, 0] = True
    halves = [slice(0, 2), slice(2, 4)]
    num_tokens = mask.sum()
    summed = sum(token_mean(loss[rows], mask[rows], normalizer=num_tokens) for rows in halves)
    torch.testing.assert_close(summed, token_mean(loss, mask))
    summed = sum(seq_mean_token_mean(loss[rows], mask[rows], normalizer=4) for rows in halves)
    torch.testing.assert_close(summed, seq_mean_token_mean(loss, mask))
    summed = sum(seq_mean_token_sum_norm(loss[rows], mask[rows], max_len=8, normalizer=4) for rows in halves)
    torch.testing.assert_close(summed, seq_mean_token_sum_norm(loss, mask, max_len=8))
