"""``DecodeKV``: decode rows read contiguous copies of their KV; the engine must not notice."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import full_forward_logprobs
from tether.engine import EngineConfig, LLMEngine, SamplingParams
from tether.engine.attention import SeqSpan
from tether.engine.kv_cache import DecodeKV, KVCache
from tether.models import load_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2", seed=5)


KEY_LAYOUTS = [True, False]  # keys held transposed or not


def _generate(
    path, use_decode_kv: bool, num_kv_blocks: int, dtype: torch.dtype = torch.float32,
    keys_transposed: bool | None = None,
) -> list:
    config = EngineConfig(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=24)
    engine = LLMEngine(load_model(path).to(dtype), config=config)
    runner = engine.runner
    # bf16 KV is held in fp32 (attended by the fp32 matmuls), keys in the CPU's faster layout like fp32's
    assert runner.decode_kv.kv_dtype == torch.float32
    if keys_transposed is not None:  # before the first step: the copies are still empty
        runner.decode_kv = DecodeKV(runner.cache, runner.decode_kv.max_tokens, keys_transposed)
    if not use_decode_kv:
        runner.decode_kv.max_tokens = 0  # every step over the cap: gather from the pool
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 47)), [44], [5, 6, 7, 8, 9, 60]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=m, seed=7 + m, n=3) for m in (9, 14, 5, 20, 11)]
    return engine.generate(prompts, params), engine.stats


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
@pytest.mark.parametrize("num_kv_blocks", [200, 24])  # 24: the pool runs out, sequences get preempted
def test_engine_samples_the_same_with_and_without_decode_kv(model_path, num_kv_blocks, keys_transposed):
    with_copies, stats = _generate(model_path, True, num_kv_blocks, keys_transposed=keys_transposed)
    gathered, _ = _generate(model_path, False, num_kv_blocks)
    if num_kv_blocks == 24:
        assert stats.num_preemptions > 0  # the refill path after a recompute is exercised
    for a, b in zip(with_copies, gathered):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_bf16_copies_are_as_accurate_as_the_pool(model_path, keys_transposed):
    # bf16: the copies hold KV in fp32 and attend by fp32 matmuls, the pool's rows go through
    # SDPA's bf16 kernel; their roundings differ (a sampled token near a CDF boundary can flip), so
    # each path's log-probs are held to an fp32 forward over its own samples, not to each other.
    hf = AutoModelForCausalLM.from_pretrained(model_path).float().eval()
    errors = {}
    for use_decode_kv in (True, False):
        completions, stats = _generate(
            model_path, use_decode_kv, 200, torch.bfloat16, keys_transposed if use_decode_kv else None
        )
        params = SamplingParams(temperature=1.0)
        errors[use_decode_kv] = torch.cat([
            (torch.tensor(c.logprobs) - full_forward_logprobs(hf, c, params)).abs() for c in completions
        ]).mean().item()
    assert errors[True] <= 1.5 * errors[False] + 1e-3, errors


def test_only_fp32_copies_are_transposed():
    bf16 = KVCache.allocate(1, 4, BLOCK_SIZE, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert DecodeKV(bf16, max_tokens=16, keys_transposed=True).kv_dtype == torch.float32  # KV held in fp32
    fp16 = KVCache.allocate(1, 4, BLOCK_SIZE, 2, 8, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="only fp32 keys may be transposed"):
        DecodeKV(fp16, max_tokens=16, keys_transposed=True)


def _pool_context(pool: torch.Tensor, span: SeqSpan, length: int) -> torch.Tensor:
    """Layer 0 keys or values of ``span``'s first ``length`` tokens, gathered by hand: [Hkv, length, D]."""
    rows = [pool[0, span.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(length)]
    return torch.stack(rows, dim=1)


def _held(copy: torch.Tensor, is_transposed: bool, slot: int, length: int) -> torch.Tensor:
    """A ``DecodeKV`` copy's first ``length`` tokens of ``slot`` in layer 0, as [Hkv, length, D]."""
    held = copy[0, slot]
    return held[..., :length].transpose(-1, -2) if is_transposed else held[:, :length]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: KV held in fp32
@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_assign_keeps_continuing_rows_compacts_and_refills(keys_transposed, dtype):
    pool = KVCache.allocate(1, 16, BLOCK_SIZE, 2, 8, dtype, torch.device("cpu"))
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    decode_kv = DecodeKV(pool, 1000, keys_transposed)
    assert decode_kv.k.dtype == torch.float32 and decode_kv.v.dtype == torch.float32

    def assert_holds(slot: int, span: SeqSpan, length: int) -> None:
        held_keys = _held(decode_kv.k, keys_transposed, slot, length)
        assert torch.equal(held_keys.to(dtype), _pool_context(pool.k, span, length))
        assert torch.equal(_held(decode_kv.v, False, slot, length).to(dtype), _pool_context(pool.v, span, length))

    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    spans = [SeqSpan(9, 1, tables[0]), SeqSpan(2, 3, tables[1]), SeqSpan(5, 1, tables[1]),
             SeqSpan(6, 1, tables[2])]
    order = decode_kv.assign(spans, pool, BLOCK_SIZE)
    assert order == [0, 2, 3]  # decode rows only (span 1 is a prefill chunk), in slot order
    for slot, row in enumerate(order):  # filled from the pool: the tokens before the new one
        assert_holds(slot, spans[row], spans[row].start)
    marker = decode_kv.k[0, 2].clone()
    # Next step: row 0 finished, the others continue one token further: tables[2] moves to slot 0.
    spans = [SeqSpan(6, 1, tables[1]), SeqSpan(7, 1, tables[2])]
    assert decode_kv.assign(spans, pool, BLOCK_SIZE) == [1, 0]
    assert decode_kv.lengths[:2] == [8, 7]
    assert torch.equal(decode_kv.k[0, 0], marker)
    # A new row joins: the two continuing rows keep their slots, the new one is filled.
    spans = [SeqSpan(7, 1, tables[1]), SeqSpan(3, 1, [8]), SeqSpan(8, 1, tables[2])]
    assert decode_kv.assign(spans, pool, BLOCK_SIZE) == [2, 0, 1]
    assert_holds(2, spans[1], 3)
    # A row whose start does not continue its slot (rolled back) is refilled from the pool.
    pool.k[0, 4] += 1.0
    spans = [SeqSpan(5, 1, tables[1])]
    assert decode_kv.assign(spans, pool, BLOCK_SIZE) == [0]
    assert_holds(0, spans[0], 5)


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_a_new_shape_within_the_storage_reuses_it_and_refills_every_row(keys_transposed):
    """A wide batch, then fewer rows with longer contexts, then a wide batch again (an RL rollout, and
    the next one): within the storage already held no memory is allocated (fresh pages cost 30-400 ms
    per 150 MB on a shared VM), every row holds exactly its pool context again, padding is zeros."""
    pool = KVCache.allocate(1, 64, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    decode_kv = DecodeKV(pool, max_tokens=96, keys_transposed=keys_transposed)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(8)]
    storage_ptrs = set()
    for step, (num_rows, start) in enumerate([(8, 7), (8, 8), (3, 30), (3, 31), (8, 9)]):
        spans = [SeqSpan(start, 1, tables[i]) for i in range(num_rows)]
        assert decode_kv.assign(spans, pool, BLOCK_SIZE) == list(range(num_rows))
        if step >= 1:  # grown to the cap: (8, 8) -> (8, 12)
            storage_ptrs.add(decode_kv.v.data_ptr())
        assert decode_kv.num_slots * decode_kv.capacity <= 96
        for slot, span in enumerate(spans):
            assert torch.equal(_held(decode_kv.k, keys_transposed, slot, start), _pool_context(pool.k, span, start))
            assert torch.equal(_held(decode_kv.v, False, slot, start), _pool_context(pool.v, span, start))
        # past the blocks gathered: zeros, never another shape's leftovers
        width = -(-(start + 1) // BLOCK_SIZE) * BLOCK_SIZE
        assert not decode_kv.v[:, :num_rows, :, width:].any()
    assert decode_kv.num_slots == 8 and decode_kv.capacity == 12  # (8, 12) -> (3, 32) -> (8, 12)
    assert len(storage_ptrs) == 1  # re-viewed, not reallocated


def test_assign_over_the_memory_cap_falls_back_to_the_pool():
    pool = KVCache.allocate(1, 16, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    decode_kv = DecodeKV(pool, max_tokens=8)
    spans = [SeqSpan(9, 1, [0, 1, 2])]  # needs 12 token slots
    assert decode_kv.assign(spans, pool, BLOCK_SIZE) is None
