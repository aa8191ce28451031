"""The simple sampler: static batches with a contiguous KV cache, behind the ``Generator`` interface.

Every prompt x sample is one row; prompts are left-padded, prefilled together, then all rows decode
one token per step until every row has finished. It is the reference the paged engine
(``tether.engine.engine``) is checked against and the static-batching baseline in benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tether.algorithms.logprobs import process_logits
from tether.engine.types import Completion, SamplingParams
from tether.models.attention import ContiguousKVCache


def row_generators(seeds: Sequence[int | None], sample_indices: Sequence[int]) -> list[torch.Generator]:
    """One generator per row, seeded from (request seed, sample index) so a row's sample does not
    depend on which other rows share its batch. Unseeded rows draw a seed from torch's global RNG."""
    gens = []
    for seed, sample in zip(seeds, sample_indices):
        base = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        gens.append(torch.Generator().manual_seed((base * 1_000_003 + sample) % 2**63))
    return gens


def sample_rows(logprobs: torch.Tensor, is_greedy: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """logprobs ``[N, V]`` (processed) -> token ids ``[N]``: argmax for greedy rows, else exponential-race
    sampling (argmax of p / E with E ~ Exp(1), equivalent to multinomial) with each row's generator."""
    noise = torch.empty_like(logprobs)
    for row, gen in enumerate(gens):
        noise[row].exponential_(generator=gen)
    sampled = (logprobs - noise.log()).argmax(dim=-1)
    return torch.where(is_greedy, logprobs.argmax(dim=-1), sampled)


class StaticBatchGenerator:
    def __init__(self, model: torch.nn.Module, eos_token_ids: Iterable[int] = (), pad_token_id: int = 0) -> None:
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.version = 0

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if params[name] is not tensor:
                    params[name].copy_(tensor)
        self.version = version

    def abort(self, request_ids: Iterable[int] | None = None) -> None:
        """Static batches run to completion inside ``generate``; nothing is ever in flight between calls."""

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        rows = [(p, s) for p in range(len(prompts)) for s in range(per_prompt[p].n)]
        if not rows:
            return []
        sp = [per_prompt[p] for p, _ in rows]
        outs = [Completion(p, s, list(prompts[p])) for p, s in rows]
        prompt_len = max(len(prompts[p]) for p, _ in rows)
        max_new = max(x.max_new_tokens for x in sp)
        ids = torch.full((len(rows), prompt_len), self.pad_token_id, dtype=torch.long)
        real = torch.zeros(len(rows), prompt_len, dtype=torch.bool)
        for r, (p, _) in enumerate(rows):  # left padding: every row's last prompt token is aligned
            ids[r, prompt_len - len(prompts[p]):] = torch.tensor(prompts[p])
            real[r, prompt_len - len(prompts[p]):] = True
        cache = ContiguousKVCache.for_model(self.model.config, len(rows), prompt_len + max_new,
                                            dtype=next(self.model.parameters()).dtype)
        cache.set_padding(real)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [N, T]
        temperature = torch.tensor([x.temperature for x in sp])
        top_k, top_p = torch.tensor([x.top_k for x in sp]), torch.tensor([x.top_p for x in sp])
        min_p = torch.tensor([x.min_p for x in sp])
        gens = row_generators([x.seed for x in sp], [s for _, s in rows])
        is_done = torch.zeros(len(rows), dtype=torch.bool)
        hidden = self.model(ids, positions, cache)[:, -1]  # [N, H]: prefill
        next_pos = positions[:, -1] + 1  # [N]
        for _ in range(max_new):
            logprobs = process_logits(self.model.compute_logits(hidden), temperature, top_k, top_p, min_p)
            tokens = sample_rows(logprobs, temperature == 0, gens)  # [N]
            token_logp = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
            self._append(outs, sp, tokens.tolist(), token_logp.tolist(), is_done)
            if bool(is_done.all()):
                break
            hidden = self.model(tokens[:, None], next_pos[:, None], cache)[:, -1]
            next_pos = next_pos + 1
        return outs

    def _append(self, outs: list[Completion], sp: list[SamplingParams], tokens: list[int],
                logps: list[float], is_done: torch.Tensor) -> None:
        for r, out in enumerate(outs):
            if is_done[r]:
                continue
            out.token_ids.append(tokens[r])
            out.logprobs.append(logps[r])
            out.versions.append(self.version)
            if tokens[r] in self.eos_token_ids or tokens[r] in sp[r].stop_token_ids:
                out.finish_reason, is_done[r] = "stop", True
            elif out.num_tokens >= sp[r].max_new_tokens:
                out.finish_reason, is_done[r] = "length", True
