"""Reference quantities computed with transformers itself, for checking the engine against them."""

import torch

from tether.algorithms.logprobs import process_logits
from tether.engine.types import Completion, SamplingParams


def full_forward_logprobs(hf, completion: Completion, params: SamplingParams) -> torch.Tensor:
    """Log-probs of a completion's tokens from one full transformers forward (on ``hf``'s device), under
    ``process_logits``, as a CPU tensor."""
    ids = torch.tensor([completion.prompt_ids + completion.token_ids], device=hf.device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(completion.prompt_ids) - 1 : -1]  # [n, V]
    processed = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    tokens = torch.tensor(completion.token_ids, device=logits.device)
    return processed.gather(-1, tokens[:, None]).squeeze(-1).cpu()


def assert_same_completions(got: list[Completion], expected: list[Completion], atol: float = 1e-4) -> None:
    """The same tokens, and log-probs within ``atol``, completion by completion."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=atol, rtol=0.0)
