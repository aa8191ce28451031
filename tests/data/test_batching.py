from __future__ import annotations

import pytest
import torch

from tether.data import PackedBatch, SFTExample, pack, pack_by_token_budget, shift_targets


def example(num_prompt: int, num_completion: int, first_id: int = 10) -> SFTExample:
    ids = list(range(first_id, first_id + num_prompt + num_completion))
    return SFTExample(ids, [False] * num_prompt + [True] * num_completion)


def test_pack_concatenates_with_restarting_positions():
    batch = pack([example(2, 1, first_id=10), example(1, 2, first_id=20)])
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 22]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert batch.seq_lens == [3, 3]
    assert batch.loss_mask.tolist() == [[False, False, True, False, True, True]]
    assert batch.num_loss_tokens == 3
    assert batch.cu_seqlens.tolist() == [0, 3, 6]
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.bool


def test_shift_targets_by_hand():
    batch = pack([example(2, 1, first_id=10), example(1, 2, first_id=20)])
    targets, target_mask = shift_targets(batch)
    # position t predicts token t+1; position 2 (end of seq 1) must not predict 20 (start of seq 2)
    assert targets.tolist() == [[11, 12, 20, 21, 22, 0]]
    assert target_mask.tolist() == [[False, True, False, True, True, False]]
    assert int(target_mask.sum()) == batch.num_loss_tokens


def test_a_target_never_crosses_a_boundary_even_if_loss_mask_says_so():
    ids = [5, 6, 7]
    batch = PackedBatch(
        input_ids=torch.tensor([ids + ids]),
        positions=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        seq_lens=[3, 3],
        loss_mask=torch.ones(1, 6, dtype=torch.bool),  # claims the sequence start is a target
        num_loss_tokens=6,
        example_indices=[0, 1],
    )
    _, target_mask = shift_targets(batch)
    assert target_mask.tolist() == [[True, True, False, True, True, False]]


def test_budget_first_fit_in_order_and_oversized_alone():
    lengths = [6, 5, 3, 12, 4, 2]
    examples = [example(1, n - 1) for n in lengths]
    batches = pack_by_token_budget(examples, max_tokens_per_batch=10)
    # 6 -> b0; 5 -> b1 (b0 has 4 left); 3 -> b0 (9); 12 -> b2 alone; 4 -> b1 (9); 2 -> b3? no: b2 is
    # closed, b0 has 1, b1 has 1 -> new b3.
    assert [b.example_indices for b in batches] == [[0, 2], [1, 4], [3], [5]]
    for b in batches:
        assert b.num_tokens <= 10 or b.num_sequences == 1
        assert b.seq_lens == [lengths[i] for i in b.example_indices]
    assert sorted(i for b in batches for i in b.example_indices) == list(range(len(lengths)))


def test_packed_loss_equals_per_sequence_loss():
    # The trainer's next-token loss over a packed batch must equal the loss over each sequence alone.
    torch.manual_seed(0)
    examples = [example(3, 4, first_id=1), example(2, 2, first_id=3), example(4, 1, first_id=0)]
    vocab = 16
    table = torch.randn(vocab, vocab)  # a "model" whose logits depend only on the current token

    def summed_loss(batch):
        logits = table[batch.input_ids]  # [1, T, V]
        targets, mask = shift_targets(batch)
        losses = torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="none")
        return (losses * mask[0]).sum()

    packed = summed_loss(pack(examples))
    alone = sum(summed_loss(pack([e])) for e in examples)
    torch.testing.assert_close(packed, alone)


def test_bad_inputs():
    with pytest.raises(ValueError):
        pack([])
    with pytest.raises(ValueError):
        pack_by_token_budget([example(1, 1)], max_tokens_per_batch=0)
    with pytest.raises(ValueError):
        SFTExample([1, 2], [True, True])  # first token cannot be a target
    with pytest.raises(ValueError, match="shape"):
        PackedBatch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3), [2], torch.zeros(1, 3), 0, [0])
