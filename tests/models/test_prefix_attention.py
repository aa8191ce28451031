"""Shared-prefix attention: each prefix computed once gives what separate sequences give."""

import pytest
import torch

import tether.models.prefix_attention as prefix_attention
from helpers.hf_tiny import load_tiny_model
from tether.models.prefix_attention import SharedPrefixAttention

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    return load_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=3)


def _ids(length: int, seed: int) -> list[int]:
    return torch.randint(3, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Two prompts, their suffixes interleaved (rows of one prompt need not be adjacent), one empty suffix.
PREFIXES = [_ids(5, 0), _ids(3, 1)]
SUFFIXES = [(0, _ids(4, 2)), (1, _ids(6, 3)), (0, []), (0, _ids(1, 4)), (1, _ids(2, 5))]


def _packed(model, attention: SharedPrefixAttention) -> torch.Tensor:
    ids = [t for p in PREFIXES for t in p] + [t for _, s in SUFFIXES for t in s]
    hidden = model(torch.tensor([ids]), attention.positions(), attn=attention)
    return model.compute_logits(hidden)[0]  # [N, vocab]


def _expected(model) -> torch.Tensor:
    """Logits of every packed token from separate full forwards (the default attention)."""
    alone = [model.compute_logits(model(torch.tensor([PREFIXES[g] + s])))[0] for g, s in SUFFIXES]
    pieces = []
    for g, prefix in enumerate(PREFIXES):
        row = next(r for r, (h, _) in enumerate(SUFFIXES) if h == g)
        pieces.append(alone[row][: len(prefix)])
    pieces += [alone[r][len(PREFIXES[g]):] for r, (g, _) in enumerate(SUFFIXES)]
    return torch.cat(pieces)


def _attention(model) -> SharedPrefixAttention:
    return SharedPrefixAttention([len(p) for p in PREFIXES], [len(s) for _, s in SUFFIXES],
                                 [g for g, _ in SUFFIXES], sliding_window=model.config.sliding_window,
                                 sliding_window_layers=model.config.sliding_window_layers)


@pytest.mark.parametrize("lane_tokens,bucket_elements", [(64, 1 << 22), (1, 1 << 22), (64, 30), (1, 1)],
                         ids=["one-bucket", "lane-per-suffix", "small-buckets", "each-alone-causal"])
@pytest.mark.parametrize("which", ["model", "windowed_model"])
@torch.no_grad()
def test_shared_prefixes_equal_separate_sequences(request, monkeypatch, which, lane_tokens, bucket_elements):
    model = request.getfixturevalue(which)
    monkeypatch.setattr(prefix_attention, "LANE_QUERY_TOKENS", lane_tokens)
    monkeypatch.setattr(prefix_attention, "SUFFIX_BUCKET_ELEMENTS", bucket_elements)
    attention = _attention(model)
    if bucket_elements == 1:
        assert all(b.is_causal for b in attention._buckets)  # the no-mask path for long suffixes
    torch.testing.assert_close(_packed(model, attention), _expected(model), atol=ATOL, rtol=0)


def test_positions_restart_on_prefixes_and_continue_on_suffixes(model):
    attention = _attention(model)
    assert attention.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 2,  # the prefixes
                                               5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 5, 3, 4]]


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="suffix_prefix must index"):
        SharedPrefixAttention([3], [2], [1])
    with pytest.raises(ValueError, match="positive"):
        SharedPrefixAttention([0], [2], [0])
    with pytest.raises(ValueError, match="prefix ids"):
        SharedPrefixAttention([3], [2, 2], [0])
