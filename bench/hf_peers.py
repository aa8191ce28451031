"""transformers' generation as ``engine_throughput.py``'s peers: ``model.generate`` (one static batch)
and its continuous batching (the manager behind ``generate_batch``), on the bench's workload, with the
same sampling settings as tether's side and the same count of useful tokens. Each takes the workload
as plain lists: ``rows``, one prompt's token ids per sample, and ``budgets``, each sample's new
tokens."""

from __future__ import annotations

import time

import torch


def hf_sampling(model: torch.nn.Module, max_new_tokens: int) -> object:
    from transformers import GenerationConfig

    # eos_token_id=None with the model's generation_config cleared (build_models): no row stops early,
    # as ignore_eos; top_k=0 turns off transformers' default 50.
    return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            max_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=model.config.pad_token_id)


def run_hf_generate(model: torch.nn.Module, rows: list[list[int]], budgets: list[int]) -> int:
    """One static batch of every sample, left-padded; returns the *useful* tokens (within budgets)."""
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)  # [R, width]
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=hf_sampling(model, max(budgets)))
    num_generated = out.shape[1] - width
    assert num_generated == max(budgets), (num_generated, max(budgets))  # ran to the longest budget
    return sum(min(budget, num_generated) for budget in budgets)


def run_hf_paged(model: torch.nn.Module, rows: list[list[int]], budgets: list[int], max_len: int,
                 seed: int) -> tuple[float, int]:
    """transformers' continuous batching (``generate_batch``'s manager), one request per sample with
    its own ``max_new_tokens``; returns (seconds from the first request to the last result, tokens).

    Starting the manager (KV allocation, warm-up) is left out of the time, as tether's engine set-up
    is; its cache is sized like tether's pool (every row at ``max_len`` tokens)."""
    from transformers import ContinuousBatchingConfig

    page_size = 256
    num_pages = len(rows) * -(-max_len // page_size) + 8
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_pages, max_batch_tokens=4096,
                                         seed=seed)
    generation = hf_sampling(model, max(budgets))
    num_tokens = 0
    with model.continuous_batching_context_manager(generation_config=generation, block=True, timeout=30,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            manager.add_request(row, request_id=f"r{i}", max_new_tokens=budget, eos_token_id=-1)
        num_left = len(rows)
        while num_left:
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("no result from transformers continuous batching for 60 s")
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(result.error)
                num_tokens += len(result.generated_tokens)
                num_left -= 1
        seconds = time.perf_counter() - start
    return seconds, num_tokens
