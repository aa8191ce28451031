
from tether.engine.block_manager import BlockManager
from tether.engine.rng import SampleRNG
from tether.engine.scheduler import Scheduler, SchedulerOutput
from tether.engine.sequence import Sequence, SequenceStatus
from tether.engine.types import SamplingParams


def make_seq(num_tokens: int, seq_id: int, first_token: int = 0) -> Sequence:
    token_ids = [first_token + i for i in range(num_tokens)]
    return Sequence(
        seq_id=seq_id,
        request_id=seq_id,
        sample_index=0,
        token_ids=token_ids,
        num_prompt_tokens=num_tokens,
        params=SamplingParams(),
        stop_token_ids=frozenset(),
        rng=SampleRNG(0),
    )


def finish_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a forward: advance, then sample a token for sequences at their end."""
    for item in out.scheduled:
        seq = item.seq
        is_sampling = item.is_sampling
        before = seq.num_computed_tokens
        seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.commit(seq, before)
        if is_sampling:
            for follower in scheduler.fork(seq) if seq.followers else []:
                follower.token_ids.append(1)
            seq.token_ids.append(1)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, chunked=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, chunked)


def test_token_budget_mixes_decodes_and_prefill_chunks():
    scheduler = make_scheduler(budget=8)
    short, long = make_seq(3, 0), make_seq(20, 1, first_token=100)
    scheduler.add(short)
    scheduler.add(long)
    out = scheduler.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 3), (1, 5)]
    assert out.scheduled[0].is_sampling and not out.scheduled[1].is_sampling
    finish_step(scheduler, out)
    out = scheduler.schedule()  # a decode of 1 and the next chunk of 7
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 7)]
    assert out.num_batched_tokens == 8


def test_without_chunking_a_prefill_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=8, chunked=False)
    scheduler.add(make_seq(6, 0))
    scheduler.add(make_seq(5, 1, first_token=50))
    out = scheduler.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 6)]
    finish_step(scheduler, out)
    out = scheduler.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 5)]


def test_max_num_seqs_counts_unforked_followers():
    scheduler = make_scheduler(max_num_seqs=4)
    leader = make_seq(4, 0)
    leader.followers = [make_seq(4, i) for i in (1, 2, 3)]
    scheduler.add(leader)
    scheduler.add(make_seq(4, 9, first_token=40))
    out = scheduler.schedule()
    assert [i.seq.seq_id for i in out.scheduled] == [0]  # the group fills all four slots
    finish_step(scheduler, out)
    assert [s.seq_id for s in scheduler.running] == [0, 1, 2, 3]
    assert all(s.block_table[:1] == scheduler.running[0].block_table[:1] for s in scheduler.running)


def test_a_group_larger_than_max_num_seqs_is_still_admitted_alone():
    scheduler = make_scheduler(max_num_seqs=2)
    leader = make_seq(4, 0)
    leader.followers = [make_seq(4, i) for i in (1, 2, 3)]
    scheduler.add(leader)
    assert [i.seq.seq_id for i in scheduler.schedule().scheduled] == [0]


def test_full_pool_preempts_the_newest_and_resumes_it_later():
    # 4 blocks of 2 slots; two sequences of 3 tokens take 2 blocks each, then need more to decode.
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16)
    first, second = make_seq(3, 0), make_seq(3, 1, first_token=10)
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    assert len(out.scheduled) == 2
    finish_step(scheduler, out)  # both now hold 4 tokens (3 computed)
    finish_step(scheduler, scheduler.schedule())  # decode: slot 3 fits, 5 tokens each
    out = scheduler.schedule()  # both need a third block; none free: the newer one is preempted
    assert out.num_preempted == 1
    assert [i.seq.seq_id for i in out.scheduled] == [0]
    assert second.status is SequenceStatus.WAITING and second.block_table == []
    assert scheduler.waiting[0] is second and second.num_tokens == 5  # keeps its tokens
    finish_step(scheduler, out)
    first.status = SequenceStatus.FINISHED
    scheduler.remove_finished()
    out = scheduler.schedule()  # recompute: its first block is still cached, the other 3 tokens are not
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(1, 3)]
    assert out.num_prefix_hit_tokens == 2


def test_lone_sequence_that_cannot_grow_preempts_itself_without_crashing():
    scheduler = make_scheduler(num_blocks=1, block_size=2, budget=16)
    seq = make_seq(2, 0)
    scheduler.add(seq)
    finish_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # needs a second block that does not exist
    assert out.is_empty and out.num_preempted == 1 and seq.status is SequenceStatus.WAITING


def test_waiting_prompt_reuses_cached_prefix():
    scheduler = make_scheduler(block_size=4)
    first = make_seq(9, 0)
    scheduler.add(first)
    finish_step(scheduler, scheduler.schedule())
    second = make_seq(9, 1)  # same 9 prompt tokens
    scheduler.add(second)
    out = scheduler.schedule()
    assert out.num_prefix_hit_tokens == 8
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 1)]


def test_preempt_all_puts_everyone_back_in_order():
    scheduler = make_scheduler()
    seqs = [make_seq(3, i, first_token=10 * i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    finish_step(scheduler, scheduler.schedule())
    assert scheduler.preempt_all() == 3
    assert list(scheduler.waiting) == seqs and scheduler.block_manager.num_free_blocks == 64
