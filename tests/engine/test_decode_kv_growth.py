import torch

from tether.engine.attention import DecodeKV, KVCache, SeqSpan

BLOCK_SIZE = 4


def test_slots_grow_to_the_cap_at_once_not_a_block_per_step():
    """Decoding past the doubling cap must not reallocate the mirror every block (it did: 8 % of a run)."""
    pool = KVCache.allocate(1, 64, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    decode_kv = DecodeKV(pool, max_tokens=4 * 40)  # 4 rows x 40 tokens at most
    tables = [list(range(i * 16, i * 16 + 10)) for i in range(4)]
    num_reallocations, last_ptr = 0, None
    for start in range(1, 39):
        spans = [SeqSpan(start, 1, table) for table in tables]
        assert decode_kv.assign(spans, pool, BLOCK_SIZE) == [0, 1, 2, 3]
        if decode_kv.k.data_ptr() != last_ptr:
            num_reallocations, last_ptr = num_reallocations + 1, decode_kv.k.data_ptr()
    assert decode_kv.k.shape[1] * decode_kv.k.shape[3] <= 4 * 40
    assert decode_kv.k.shape[1] == 4  # rows are not doubled when only the slots get longer
    assert num_reallocations <= 5  # 4 -> 8 -> 16 -> 32 -> 40 tokens, not a block at a time
