"""``EngineConfig``: the knobs of the rollout engine, checked once when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

from tether.engine.types import as_stop_token_ids
from tether.errors import ConfigError

SPECULATIVE_METHODS = (None, "ngram", "draft")
MAX_BLOCK_SIZE = 1024  # tokens per KV block (vLLM's largest is 256); more only wastes the pool
# Fields by type, checked before their values (the API takes no YAML schema's conversions).
_INT_FIELDS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "seed", "num_speculative_tokens",
               "ngram_max", "ngram_min")
_OPTIONAL_INT_FIELDS = ("max_model_len", "num_kv_blocks", "kv_cache_bytes", "max_kv_tokens")
_BOOL_FIELDS = ("enable_prefix_caching", "enable_chunked_prefill", "recompute_kv_on_update", "cpu_pack_lm_head",
                "cpu_native_attention")
PACK_LINEARS_MODES = ("auto", "always", "never")  # EngineConfig.cpu_pack_linears


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences (samples, not prompts) running at once
    max_num_batched_tokens: int = 2048  # per-step token budget: prefill chunks + decodes
    max_model_len: int | None = None  # prompt + completion cap; None: the model's max positions
    # KV pool size, first one set wins: a block count, a byte budget (covering the pool, its decode
    # copies and a draft model's KV), else a fraction of free memory.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3
    # The most KV tokens the caller's workload can hold at once (an RL recipe knows it: sequences in
    # flight x their longest length): caps the pool, whatever the budget, so a small run does not
    # claim gigabytes it can never fill. None: ``max_num_seqs`` sequences at ``max_model_len``.
    max_kv_tokens: int | None = None
    enable_prefix_caching: bool = True  # reuse computed full blocks across requests (hash chain)
    enable_chunked_prefill: bool = True  # split long prompts over steps to respect the token budget
    # On a weight update, running sequences that have sampled keep the KV computed under the old
    # weights (cheaper, and the per-token ``versions`` record which policy produced each token); one
    # that has sampled nothing yet (a prompt mid-prefill) recomputes it, so that all its tokens come
    # from one policy. True instead preempts every running sequence: its whole context is recomputed
    # under the new weights.
    recompute_kv_on_update: bool = False
    stop_token_ids: tuple[int, ...] = ()  # added to every request's stop ids (e.g. the tokenizer's EOS)
    seed: int = 0  # seeds requests that bring no seed of their own
    # CPU: compute logits through a oneDNN-reordered copy of the vocabulary projection when it is
    # fp32 of at least 8 MB, or bf16 with native oneDNN bf16 (``tether.engine.cpu_kernels``): 1.2-2.3x
    # faster logits (fp32), at its size in memory.
    cpu_pack_lm_head: bool = True
    # CPU: the decoder layers' linears through oneDNN-reordered copies too: "auto" for every bf16 one
    # (native oneDNN bf16), fp32 ones 256+ wide on CPUs where MKL runs its generic kernels (non-Intel
    # x86; on an AMD EPYC host 1.3-2.6x faster decode-step linears), "always", or "never". Either
    # path computes the same products in another order (fp32: ~1e-6 relative; bf16: the same bits
    # but for rare single roundings).
    cpu_pack_linears: str = "auto"
    # CPU, fp32: attention, the MLPs' silu(gate) * up and the plain sampler's weights through C++
    # kernels compiled for this machine on first use (``tether.engine.native``; ~40 s once, cached):
    # about 2x faster decode attention than the two batched matmuls it replaces (1.0-1.2 against
    # 2.0-2.2 ms a layer at 128 rows, AMD EPYC), and ~7 % off a decode step for the other two. Where
    # they cannot be built the engine warns and uses PyTorch ops.
    cpu_native_attention: bool = True
    # Batch invariance: a token's logits are the same bits however it is scheduled (alone or in any
    # batch, prefilled in one chunk or several, from the prefix cache, in a speculative span), so a
    # seeded request samples the same tokens with the same log-probs in any batch. It holds on the
    # CPU path for fp32 models with the compiled kernel: every linear multiplies through oneDNN's
    # reordered weights (whose rows do not depend on the row count; checked on this CPU when the
    # engine starts), SiLU is computed alike at every offset, and prefill queries attend through the
    # decode kernel, each with the bits it gets alone (as the kernel's prefill does whenever it serves,
    # invariant or not). "auto": on where that path is available, else off; True: an error where it
    # is not; False: off (MKL's few-row kernels and F.silu round a row by the batch's shape, ~1e-6).
    batch_invariant: bool | str = "auto"
    # Speculative decoding (exact: the output distribution is the target's). Greedy output, and with
    # prompt lookup a seeded request's samples, equal non-speculative decoding's bit for bit where the
    # engine is batch-invariant (``LLMEngine.is_batch_invariant``); elsewhere (bf16, GPU) a verified
    # span's logits round differently from a decode row's, so a near-tie may flip, as batch
    # composition flips it in plain decoding.
    # "ngram" proposes by prompt lookup, "draft" by a small model passed as LLMEngine(draft_model=...),
    # which may have a shorter context than the target's (it stops drafting where a sequence passes it).
    speculative: str | None = None
    num_speculative_tokens: int = 4  # draft tokens verified per decode step (k)
    ngram_max: int = 4  # prompt lookup matches the last n tokens, n from ngram_max down to ngram_min
    ngram_min: int = 1

    def __post_init__(self) -> None:
        self._check_types()
        if self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"engine.block_size must be <= {MAX_BLOCK_SIZE}, got {self.block_size}")
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"engine.{name} must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"engine.max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"engine.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ConfigError(f"max_kv_tokens must be >= 1, got {self.max_kv_tokens}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"engine.kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"engine.speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if self.cpu_pack_linears not in PACK_LINEARS_MODES:
            raise ConfigError(
                f"engine.cpu_pack_linears must be one of {PACK_LINEARS_MODES}, got {self.cpu_pack_linears!r}"
            )
        if not (isinstance(self.batch_invariant, bool) or self.batch_invariant == "auto"):
            raise ConfigError(f"engine.batch_invariant must be true, false or auto, got {self.batch_invariant!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"engine.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"engine.ngram_min/ngram_max must satisfy 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min}, {self.ngram_max}"
            )
        try:
            self.stop_token_ids = as_stop_token_ids(self.stop_token_ids)
        except ValueError as error:
            raise ConfigError(f"engine.stop_token_ids must be token ids (ints >= 0): {error}") from None
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"engine.kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )

    def _check_types(self) -> None:
        for name in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):
            value = getattr(self, name)
            if (value is not None or name in _INT_FIELDS) and (isinstance(value, bool) or not isinstance(value, int)):
                kind = "an integer" if name in _INT_FIELDS else "an integer or null"
                raise ConfigError(f"engine.{name} must be {kind}, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"engine.{name} must be true or false, got {getattr(self, name)!r}")
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ConfigError(f"engine.kv_cache_memory_fraction must be a number, got {fraction!r}")
