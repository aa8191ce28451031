
from tether.engine.block_manager import BlockManager
from tether.engine.rng import SampleRNG
from tether.engine.sequence import Sequence
from tether.engine.types import SamplingParams


def make_seq(token_ids: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=seq_id,
        sample_index=0,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        params=SamplingParams(),
        stop_token_ids=frozenset(),
        rng=SampleRNG(0),
    )


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What a step does for ``seq``: allocate, 'compute', commit."""
    bm.allocate(seq, num_new)
    before = seq.num_computed_tokens
    seq.num_computed_tokens += num_new
    bm.commit(seq, before)


def test_allocate_covers_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.num_blocks_to_allocate(seq, 10) == 3
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    seq.token_ids.append(99)
    assert bm.num_blocks_to_allocate(seq, 1) == 0  # slot 10 lives in the third block
    seq.token_ids.extend([1, 2])
    compute(bm, seq, 3)
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0


def test_can_allocate_respects_pool_size():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(9)))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)


def test_prefix_hit_reuses_only_computed_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(10)), seq_id=0)
    second = make_seq(list(range(10)) + [7], seq_id=1)
    bm.allocate(first, 10)  # allocated but not computed: nothing may be reused yet
    assert bm.match_prefix(second) == 0
    bm.free(second)
    first.num_computed_tokens = 10
    bm.commit(first, 0)
    assert bm.num_cached_blocks == 2  # two full blocks; the partial third is not cached
    assert bm.match_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2


def test_prefix_match_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(8)), seq_id=0)
    compute(bm, first, 8)
    same = make_seq(list(range(8)), seq_id=1)
    assert bm.match_prefix(same) == 4  # the block holding the last token is recomputed for its logits


def test_prefix_chain_hash_depends_on_parent():
    bm = BlockManager(num_blocks=16, block_size=2)
    first = make_seq([1, 2, 3, 4, 5], seq_id=0)
    compute(bm, first, 5)
    other = make_seq([9, 9, 3, 4, 5], seq_id=1)  # same second block, different first block
    assert bm.match_prefix(other) == 0


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=2)
    first = make_seq([1, 2, 3, 4, 5], seq_id=0)
    compute(bm, first, 5)
    bm.free(first)
    again = make_seq([1, 2, 3, 4, 5, 6], seq_id=1)
    assert bm.match_prefix(again) == 4  # revived from the free list
    assert bm.num_free_blocks == 2
    bm.free(again)
    filler = make_seq(list(range(100, 108)), seq_id=2)
    compute(bm, filler, 8)  # takes every block: the cache is evicted
    bm.free(filler)
    late = make_seq([1, 2, 3, 4, 5], seq_id=3)
    assert bm.match_prefix(late) == 0


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    cached = make_seq([1, 2, 3], seq_id=0)
    compute(bm, cached, 3)  # block 0 cached, block 1 partial (uncached)
    bm.free(cached)
    taker = make_seq([7, 8], seq_id=1)
    compute(bm, taker, 2)
    assert taker.block_table[0] != cached_block_id(bm, [1, 2])


def test_a_twin_block_is_reused_before_the_cached_one():
    """Two sequences compute the same block in one step: the first registered is the cache's; the
    twin keeps the hash for its children's chain but nothing can hit it, so it goes first when freed."""
    bm = BlockManager(num_blocks=2, block_size=2)
    first, twin = make_seq([1, 2], seq_id=0), make_seq([1, 2], seq_id=1)
    bm.allocate(first, 2)
    bm.allocate(twin, 2)
    for seq in (first, twin):
        seq.num_computed_tokens = 2
        bm.commit(seq, 0)
    twin_block = twin.block_table[0]
    bm.free(first)
    bm.free(twin)  # freed last: least-recently-freed order alone would hand out the cached block first
    taker = make_seq([7, 8], seq_id=2)
    compute(bm, taker, 2)
    assert taker.block_table == [twin_block]
    assert bm.match_prefix(make_seq([1, 2, 3], seq_id=3)) == 2  # the cached block survived


def cached_block_id(bm: BlockManager, token_ids: list[int]) -> int:
    return next(b.block_id for b in bm.blocks if b.token_ids == tuple(token_ids))


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader = make_seq(list(range(6)), seq_id=0)
    compute(bm, leader, 6)
    follower = make_seq(list(range(6)), seq_id=1)
    bm.fork(leader, follower)
    assert follower.block_table == leader.block_table and follower.num_computed_tokens == 6
    shared_partial = leader.block_table[1]
    assert bm.blocks[shared_partial].ref_count == 2
    leader.token_ids.append(50)
    assert bm.num_blocks_to_allocate(leader, 1) == 1  # the copy
    bm.allocate(leader, 1)
    assert leader.block_table[1] != shared_partial and leader.block_table[0] == follower.block_table[0]
    assert bm.take_copies() == [(shared_partial, leader.block_table[1])]
    follower.token_ids.append(60)
    bm.allocate(follower, 1)  # now the sole owner: writes in place
    assert follower.block_table[1] == shared_partial and bm.take_copies() == []


def test_flush_forgets_cache_and_stale_sequences_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=2)
    first = make_seq([1, 2, 3, 4, 5], seq_id=0)
    compute(bm, first, 5)
    bm.flush_prefix_cache()
    assert bm.num_cached_blocks == 0
    probe = make_seq([1, 2, 3, 4, 5], seq_id=1)
    assert bm.match_prefix(probe) == 0
    bm.free(probe)
    first.is_kv_stale = True
    first.token_ids.extend([6, 7])
    compute(bm, first, 2)
    assert bm.num_cached_blocks == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    first = make_seq([1, 2, 3, 4, 5], seq_id=0)
    compute(bm, first, 5)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5], seq_id=1)) == 0
