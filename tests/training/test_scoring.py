"""Scoring completions: one pass over a shared prompt gives the log-probs and gradients of n passes."""

import copy

import pytest
import torch

from helpers.hf_tiny import make_hf_checkpoint
from tether.models.checkpoint import load_model
from tether.training.batch import split_by_tokens
from tether.training.scoring import SamplingView, completion_logprobs


@pytest.fixture(scope="module", params=["qwen3", "mistral"])
def model(request, tmp_path_factory):
    extra = {"sliding_window": 4} if request.param == "mistral" else {}
    return load_model(make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                         with_tokenizer=False, **extra))


def _group_batch() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts x three samples, one single-token and one empty completion, rows interleaved."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 100, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [ids(7), ids(2), ids(5)]
    rows = [(g, ids(n)) for g, n in [(0, 6), (1, 3), (0, 1), (2, 4), (1, 8), (0, 0), (2, 2), (1, 5), (2, 9)]]
    return [prompts[g] for g, _ in rows], [c for _, c in rows]


def _scored(model, share: bool):
    prompts, completions = _group_batch()
    model = copy.deepcopy(model)
    logp, entropy = completion_logprobs(model, prompts, completions, SamplingView(0.7, top_k=30),
                                        with_entropy=True, share_prompts=share)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (weights * logp).sum().backward()
    return logp.detach(), entropy, {n: p.grad for n, p in model.named_parameters()}


def test_shared_prompts_give_the_same_logprobs_and_gradients(model):
    logp, entropy, grads = _scored(model, share=True)
    logp_ref, entropy_ref, grads_ref = _scored(model, share=False)
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, entropy_ref, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)


@torch.no_grad()
def test_logprobs_equal_a_full_forward_of_each_sequence(model):
    """Both packings against the model's default attention (which applies a sliding window)."""
    prompts, completions = _group_batch()
    for share in (True, False):
        logp, _ = completion_logprobs(model, prompts, completions, SamplingView(1.0), share_prompts=share)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            if not completion:
                assert (logp[row] == 0).all()
                continue
            logits = model.compute_logits(model(torch.tensor([prompt + completion])))[0]
            expected = logits[len(prompt) - 1: -1].log_softmax(-1)
            expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(logp[row, : len(completion)], expected, atol=1e-5, rtol=0)


def test_micro_batches_count_a_shared_prompt_once():
    prompts = [[1] * 10] * 4 + [[2] * 10] * 4
    lens = [2] * 8
    assert split_by_tokens(prompts, lens, 20) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert split_by_tokens(prompts, lens, 20, share_prompts=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
