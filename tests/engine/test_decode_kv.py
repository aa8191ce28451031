"""``DecodeKV``: decode rows read contiguous copies of their KV; the engine must not notice."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_tiny import make_hf_checkpoint
from tether.engine import EngineConfig, LLMEngine, SamplingParams
from tether.engine.attention import SeqSpan
from tether.engine.kv_cache import DecodeKV, KVCache
from tether.models import load_model
from tether.training.scoring import SamplingView, completion_logprobs

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
    if dtype != torch.float32:  # bf16 keeps SDPA's layout (fp32 scores); fp32 takes the CPU's faster one
        assert not runner.decode_kv.keys_transposed
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


def test_bf16_engine_samples_the_same_with_and_without_decode_kv(model_path):
    with_copies, _ = _generate(model_path, True, 200, torch.bfloat16)
    gathered, _ = _generate(model_path, False, 200, torch.bfloat16)
    # bf16 rounding: the two paths' log-probs differed by up to 0.017 before keys were ever
    # transposed, and on a host without native bf16 matmuls (an AVX2 Zen 3) that flipped one
    # near-tied draw of 177 (the 9th token of a sample: -7.14 against -5.78). So the samples must
    # agree up to such a flip, and over nearly all their tokens; copies that attended wrongly would
    # part at once.
    num_common = 0
    for a, b in zip(with_copies, gathered):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        num_common += common
        assert torch.allclose(torch.tensor(a.logprobs[:common]), torch.tensor(b.logprobs[:common]), atol=0.05)
    assert num_common >= 0.9 * sum(c.num_tokens for c in with_copies)


def test_bf16_engine_logprobs_stay_close_to_the_bf16_trainer(model_path):
    # A bf16 engine's log-probs feed the loop's importance weights against the bf16 trainer's: its
    # decode rows attend by SDPA on bf16 copies, the trainer's forward's kernel. Copies held in fp32
    # for the fp32 matmuls (as accurate against an fp32 reference) measured 0.0053 here, this 0.0011.
    engine = LLMEngine(load_model(model_path).to(torch.bfloat16),
                       config=EngineConfig(num_kv_blocks=400, block_size=BLOCK_SIZE, max_num_batched_tokens=64))
    assert engine.runner.decode_kv.k.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (7, 3, 17, 1, 12, 9, 25, 5)]
    completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=60, seed=3, n=4))
    assert engine.runner.decode_kv.num_slots > 0  # the decode rows did read the copies
    trainer = load_model(model_path).to(torch.bfloat16).eval()
    with torch.no_grad():
        logprobs, _ = completion_logprobs(trainer, [c.prompt_ids for c in completions],
                                          [c.token_ids for c in completions], SamplingView())
    gaps = torch.cat([(logprobs[i, : len(c.token_ids)] - torch.tensor(c.logprobs)).abs()
                      for i, c in enumerate(completions)])
    assert gaps.mean().item() < 0.0025, gaps.mean().item()


def test_only_fp32_copies_are_transposed():
    pool = KVCache.allocate(1, 4, BLOCK_SIZE, 2, 8, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="only fp32 keys may be transposed"):
        DecodeKV(pool, max_tokens=16, keys_transposed=True)


def _pool_context(pool: torch.Tensor, span: SeqSpan, length: int) -> torch.Tensor:
    """Layer 0 keys or values of ``span``'s first ``length`` tokens, gathered by hand: [Hkv, length, D]."""
    rows = [pool[0, span.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(length)]
    return torch.stack(rows, dim=1)


def _held(copy: torch.Tensor, is_transposed: bool, slot: int, length: int) -> torch.Tensor:
    """A ``DecodeKV`` copy's first ``length`` tokens of ``slot`` in layer 0, as [Hkv, length, D]."""
    held = copy[0, slot]
    return held[..., :length].transpose(-1, -2) if is_transposed else held[:, :length]


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_assign_keeps_continuing_rows_compacts_and_refills(keys_transposed):
    pool = KVCache.allocate(1, 16, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    decode_kv = DecodeKV(pool, 1000, keys_transposed)

    def assert_holds(slot: int, span: SeqSpan, length: int) -> None:
        assert torch.equal(_held(decode_kv.k, keys_transposed, slot, length), _pool_context(pool.k, span, length))
        assert torch.equal(_held(decode_kv.v, False, slot, length), _pool_context(pool.v, span, length))

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
