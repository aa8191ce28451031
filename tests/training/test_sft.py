"""SFT's packed loss: several examples in one row score as each example alone."""

import torch
import torch.nn.functional as F

from helpers.hf_tiny import make_hf_checkpoint
from tether.data.batching import pack_by_token_budget
from tether.data.tokenize import SFTExample
from tether.models.checkpoint import load_model
from tether.training.sft import packed_nll


@torch.no_grad()
def test_packed_nll_equals_each_example_alone_with_a_sliding_window(tmp_path):
    """The window is the checkpoint's: packed training must apply it as a plain forward does."""
    model = load_model(make_hf_checkpoint(tmp_path, "mistral", with_tokenizer=False, sliding_window=3))
    gen = torch.Generator().manual_seed(0)
    examples = []
    for length, num_prompt in [(9, 3), (12, 5), (4, 1)]:
        ids = torch.randint(3, 100, (length,), generator=gen).tolist()
        examples.append(SFTExample(ids, [False] * num_prompt + [True] * (length - num_prompt)))
    (batch,) = pack_by_token_budget(examples, 1000)
    nll, num_targets = packed_nll(model, batch)
    expected = 0.0
    for example in examples:
        logits = model.compute_logits(model(torch.tensor([example.input_ids])))[0]
        mask = torch.tensor(example.loss_mask[1:])
        expected += F.cross_entropy(logits[:-1][mask], torch.tensor(example.input_ids[1:])[mask], reduction="sum")
    assert num_targets == sum(sum(e.loss_mask) for e in examples)
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=1e-5)
