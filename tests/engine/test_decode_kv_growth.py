import pytest
import torch

from tether.engine.attention import SeqSpan
from tether.engine.kv_cache import DecodeKV, KVCache

BLOCK_SIZE = 4


KEY_LAYOUTS = [True, False]  # keys held transposed or not


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_slots_grow_to_the_cap_at_once_not_a_block_per_step(keys_transposed):
    """Decoding past the doubling cap must not reallocate the mirror every block (it did: 8 % of a run)."""
    pool = KVCache.allocate(1, 64, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    decode_kv = DecodeKV(pool, 4 * 40, keys_transposed)  # 4 rows x 40 tokens at most
    tables = [list(range(i * 16, i * 16 + 10)) for i in range(4)]
    num_reallocations, last_ptr = 0, None
    for start in range(1, 39):
        spans = [SeqSpan(start, 1, table) for table in tables]
        assert decode_kv.assign(spans, pool, BLOCK_SIZE) == [0, 1, 2, 3]
        if decode_kv.v.data_ptr() != last_ptr:
            num_reallocations, last_ptr = num_reallocations + 1, decode_kv.v.data_ptr()
    assert decode_kv.num_slots * decode_kv.capacity <= 4 * 40
    assert decode_kv.num_slots == 4  # rows are not doubled when only the slots get longer
    assert num_reallocations <= 5  # 4 -> 8 -> 16 -> 32 -> 40 tokens, not a block at a time


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_memory_stays_within_the_cap_when_the_batch_narrows_and_lengthens(keys_transposed):
    """A wide batch, then a few long stragglers (the end of every RL rollout): the copies must stay
    within ``max_tokens`` (they used to keep every old row at the new length: 12.8x the cap)."""
    cap = 20_480
    pool = KVCache.allocate(1, 4096, BLOCK_SIZE, 1, 4, torch.float32, torch.device("cpu"))
    decode_kv = DecodeKV(pool, cap, keys_transposed)
    for num_rows, length in [(256, 32), (200, 80), (10, 512), (2, 1024)]:
        tables = [list(range(i * 8, i * 8 + length // BLOCK_SIZE)) for i in range(num_rows)]
        spans = [SeqSpan(length - 1, 1, table) for table in tables]
        assert decode_kv.assign(spans, pool, BLOCK_SIZE) == list(range(num_rows))
        assert decode_kv.num_slots * decode_kv.capacity <= cap, (num_rows, length, decode_kv.v.shape)
        assert len(decode_kv.tables) == len(decode_kv.lengths) == decode_kv.num_slots


@pytest.mark.parametrize("keys_transposed", KEY_LAYOUTS)
def test_shapes_at_the_cap_share_one_storage_whatever_their_rounding(keys_transposed):
    """Shapes at the cap hold ``rows x (max_tokens // rows)`` tokens, a little under the cap by
    rounding: 3 x 33 = 99 and then 4 x 25 = 100 must re-view one storage (a rollout whose batch then
    widens again reallocated 150 MB on every run of the engine benchmark, 68 x 726 then 128 x 386)."""
    pool = KVCache.allocate(1, 64, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    decode_kv = DecodeKV(pool, 100, keys_transposed)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(8)]
    pointers = []
    for num_rows, start in [(8, 7), (3, 30), (4, 20)]:
        spans = [SeqSpan(start, 1, tables[i]) for i in range(num_rows)]
        assert decode_kv.assign(spans, pool, BLOCK_SIZE) == list(range(num_rows))
        assert decode_kv.num_slots * decode_kv.capacity <= 100
        pointers.append(decode_kv.v.data_ptr())
        for slot, span in enumerate(spans):  # every row holds its context in the new shape
            held = decode_kv.v[0, slot, :, :start]
            expected = pool.v[0, span.block_table].reshape(-1, 2, 8)[:start].transpose(0, 1)
            assert torch.equal(held, expected)
    assert (decode_kv.num_slots, decode_kv.capacity) == (4, 25)
    assert pointers[1] == pointers[2]  # (3, 33) -> (4, 25): the same storage, re-viewed
    assert decode_kv._storage["v"].numel() == 100 * 2 * 8  # the cap, never more
