"""Reference quantities computed with transformers itself, for checking the engine against them."""

import torch

from tether.algorithms.logprobs import process_logits
from tether.engine.types import Completion, SamplingParams


def full_forward_logprobs(hf, completion: Completion, params: SamplingParams) -> torch.Tensor:
    """Log-probs of a completion's tokens from one full transformers forward, under ``process_logits``."""
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(completion.prompt_ids) - 1 : -1]  # [n, V]
    processed = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return processed.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
