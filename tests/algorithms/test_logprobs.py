import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tether.algorithms.logprobs import entropy_from_logits, gather_token_logprobs, process_logits

NEG_INF = float("-inf")


def _log(probs):
    return torch.tensor(probs).log()


def numpy_reference(logits, temperature, top_k, top_p, min_p):
    """The sampling distribution of one row, written the slow obvious way. [V] -> log-probs [V]."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        shifted = logits - logits.max()
        return shifted - np.log(np.exp(shifted).sum())
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    kept = list(order[:top_k] if top_k > 0 else order)
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for token, prob in zip(kept, probs):
            nucleus.append(token)
            mass += prob
            if mass >= top_p:
                break
        kept = nucleus
    best = np.exp(scaled[kept].max())
    kept = [t for t in kept if np.exp(scaled[t]) >= min_p * best]
    out = np.full_like(scaled, -np.inf)
    out[kept] = scaled[kept] - np.log(np.exp(scaled[kept]).sum())
    return out


def test_top_k_hand_computed():
    # Keep logits 2 and 3: log-probs log(1 / (1 + e)) = -1.31326 and log(e / (1 + e)) = -0.31326.
    out = process_logits(torch.tensor([0.0, 1.0, 2.0, 3.0]), temperature=1.0, top_k=2)
    expected = torch.tensor([NEG_INF, NEG_INF, -math.log1p(math.e), 1 - math.log1p(math.e)])
    torch.testing.assert_close(out, expected)


def test_top_p_keeps_smallest_nucleus_reaching_p():
    # Probs 0.1, 0.2, 0.3, 0.4; top_p=0.5: 0.4 alone is < 0.5, 0.4 + 0.3 reaches it -> renormalised 3/7, 4/7.
    out = process_logits(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_p=0.5)
    expected = torch.tensor([NEG_INF, NEG_INF, math.log(3 / 7), math.log(4 / 7)])
    torch.testing.assert_close(out, expected)


def test_top_p_mass_exactly_at_p_stops_the_nucleus():
    # Probs 0.25, 0.25, 0.5 (exact in binary), top_p=0.5: the top token alone reaches 0.5 -> keep it only.
    out = process_logits(_log([0.25, 0.25, 0.5]), temperature=1.0, top_p=0.5)
    assert torch.equal(out, torch.tensor([NEG_INF, NEG_INF, 0.0]))


def test_tiny_top_p_always_keeps_the_top_token():
    out = process_logits(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_p=1e-6)
    assert torch.equal(out, torch.tensor([NEG_INF, NEG_INF, NEG_INF, 0.0]))


def test_top_p_applies_after_top_k():
    # top_k=3 leaves 0.2, 0.3, 0.4 -> renormalised 2/9, 3/9, 4/9; top_p=0.7: 4/9 = 0.444 < 0.7,
    # 7/9 = 0.778 >= 0.7 -> keep 3/7, 4/7 (on the un-truncated probs 0.4 + 0.3 = 0.7 would be the edge).
    out = process_logits(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_k=3, top_p=0.7)
    expected = torch.tensor([NEG_INF, NEG_INF, math.log(3 / 7), math.log(4 / 7)])
    torch.testing.assert_close(out, expected)


def test_min_p_hand_computed():
    # min_p=0.6 x max prob 0.4 = 0.24: keep 0.3 and 0.4 -> 3/7, 4/7.
    out = process_logits(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, min_p=0.6)
    expected = torch.tensor([NEG_INF, NEG_INF, math.log(3 / 7), math.log(4 / 7)])
    torch.testing.assert_close(out, expected)


def test_equal_logits_at_a_threshold_are_kept_together():
    # Top-k 2 of [1, 3, 2, 2, 0]: 3 and both 2s (ties with the k-th largest stay, as in HF and vLLM).
    out = process_logits(torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0]), temperature=1.0, top_k=2)
    assert out.isfinite().tolist() == [False, True, True, True, False]
    # Probs 0.4, 0.2, 0.2, 0.2 and top-p 0.5: the more likely mass before each 0.2 is 0.4 < 0.5, so
    # all three 0.2s are in, not the one the sort happened to put first.
    out = process_logits(_log([0.2, 0.4, 0.2, 0.2]), temperature=1.0, top_p=0.5)
    torch.testing.assert_close(out, _log([0.2, 0.4, 0.2, 0.2]))


def test_filters_depend_on_the_values_not_on_where_the_sort_puts_ties():
    """bf16-rounded logits tie often: permuting a row's vocabulary permutes its log-probs exactly,
    so the trainer's device (whose sort may order ties otherwise) keeps the engine's tokens."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 300, generator=generator) * 2).bfloat16().float()
    assert (logits[:, :, None] == logits[:, None, :]).sum() > logits.numel()  # ties there are
    for top_k, top_p, min_p in [(7, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.3), (20, 0.9, 0.05)]:
        out = process_logits(logits, 0.8, top_k=top_k, top_p=top_p, min_p=min_p)
        perm = torch.randperm(300, generator=generator)
        permuted = process_logits(logits[:, perm], 0.8, top_k=top_k, top_p=top_p, min_p=min_p)
        assert torch.equal(permuted.isfinite(), out[:, perm].isfinite())
        torch.testing.assert_close(permuted, out[:, perm], rtol=0, atol=1e-6)


def test_temperature_scales_logits():
    # Logits [0, 2] / 2 = [0, 1]: log-probs -log(1 + e), 1 - log(1 + e).
    out = process_logits(torch.tensor([0.0, 2.0]), temperature=2.0)
    torch.testing.assert_close(out, torch.tensor([-math.log1p(math.e), 1 - math.log1p(math.e)]))


def test_temperature_zero_is_raw_log_softmax_without_filtering():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    out = process_logits(logits, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)
    torch.testing.assert_close(out, torch.log_softmax(logits, dim=-1))


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1), (0.6, 20, 0.9, 0.05)],
)
def test_matches_numpy_and_transformers_warpers(temperature, top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator) * 3
    out = process_logits(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    for row in range(logits.shape[0]):
        expected = numpy_reference(logits[row].numpy(), temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(out[row].numpy(), expected, rtol=1e-5, atol=1e-5)

    # Same kept set and probabilities as transformers' warper chain (temperature -> top-k -> top-p -> min-p).
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    hf = torch.log_softmax(warpers(torch.zeros(6, 1, dtype=torch.long), logits.clone()), dim=-1)
    torch.testing.assert_close(out, hf)


def test_kept_tokens_sum_to_one():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    out = process_logits(logits, temperature=0.8, top_k=30, top_p=0.9, min_p=0.02)
    torch.testing.assert_close(out.exp().sum(dim=-1), torch.ones(4))
    assert out.dtype == torch.float32


def test_per_row_parameters_match_row_by_row_calls():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(2)) * 2
    settings = [(1.0, 0, 1.0, 0.0), (0.5, 5, 1.0, 0.0), (0.0, 3, 0.5, 0.0), (1.5, 0, 0.7, 0.1)]
    temperature, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*settings))
    batched = process_logits(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for row, (t, k, p, m) in enumerate(settings):
        torch.testing.assert_close(batched[row], process_logits(logits[row], t, top_k=k, top_p=p, min_p=m))


def test_gather_matches_process_logits_in_chunks_with_per_row_params():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 30, generator=generator)  # [B, T, V]
    targets = torch.randint(0, 30, (2, 5), generator=generator)
    temperature = torch.tensor([[0.7], [1.2]])  # per sequence, broadcast over T
    top_p = torch.tensor([[1.0], [0.95]])
    out = gather_token_logprobs(logits, targets, temperature=temperature, top_p=top_p, chunk_rows=3)
    full = process_logits(logits, temperature, top_p=top_p)
    torch.testing.assert_close(out, full.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    assert out.shape == (2, 5)


def test_gather_plain_path_is_fp32_and_differentiable():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 16, generator=generator).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 16, (3, 4), generator=generator)
    out = gather_token_logprobs(logits, targets, chunk_rows=5)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    # d/dlogits of sum_t log p(target_t) = onehot(target) - softmax.
    probs = torch.softmax(logits.detach().float(), dim=-1)
    onehot = torch.nn.functional.one_hot(targets, 16).float()
    torch.testing.assert_close(logits.grad.float(), onehot - probs, atol=1e-2, rtol=1e-2)


def test_gather_of_a_filtered_target_is_minus_inf():
    out = gather_token_logprobs(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([0]), top_k=2)
    assert out.item() == NEG_INF


def test_entropy_hand_computed_and_nan_free_on_filtered_logits():
    # Uniform over 4 -> log 4; [0, 0, -inf] -> two equal tokens -> log 2.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, NEG_INF, NEG_INF]], requires_grad=True)
    out = entropy_from_logits(logits, chunk_rows=1)
    torch.testing.assert_close(out, torch.tensor([math.log(4), math.log(2)]))
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_of_skewed_distribution():
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2.
    out = entropy_from_logits(_log([0.5, 0.25, 0.25]))
    torch.testing.assert_close(out, torch.tensor(1.5 * math.log(2)))
