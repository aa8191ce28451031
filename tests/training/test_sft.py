"""SFT's packed loss: several examples in one row score as each example alone."""

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_tiny import make_hf_checkpoint
from tether.data.batching import pack_by_token_budget
from tether.data.tokenize import SFTExample
from tether.errors import DataError
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


def test_sft_recipe_trains_on_the_configured_threads_and_restores_them(tmp_path, monkeypatch):
    """``trainer.num_threads`` applies to SFT as it does to GRPO; the caller's setting comes back."""
    from tether.config import load_config
    from tether.recipes.sft import run_sft
    from tether.training.sft import SFTTrainer

    seen = []
    train_step = SFTTrainer.train_step
    monkeypatch.setattr(SFTTrainer, "train_step",
                        lambda self, examples: seen.append(torch.get_num_threads()) or train_step(self, examples))
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    config = load_config(None, [
        "recipe=sft", "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64",
        "model.scratch.num_layers=1", "trainer.max_steps=2", "trainer.batch_size=4", f"trainer.num_threads={wanted}",
        "data.num_train=8", "data.num_eval=4", "logging.progress=none"])
    try:
        run_sft(config, tmp_path / "run")
        assert seen == [wanted, wanted] and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_examples_longer_than_the_models_context_are_cut_there_with_one_warning(tmp_path, capsys, monkeypatch):
    """data.max_seq_len above the model's max_position_embeddings: the long examples are cut at the
    context (a position past it is never trained) and one warning says how many."""
    import json

    from tether.config import load_config
    from tether.recipes.sft import run_sft
    from tether.training.sft import SFTTrainer

    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "3+4=", "completion": "7" * 60}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = []
    train_step = SFTTrainer.train_step
    monkeypatch.setattr(SFTTrainer, "train_step", lambda self, examples: lengths.extend(
        len(e.input_ids) for e in examples) or train_step(self, examples))
    config = load_config(None, [
        "recipe=sft", "data.task=null", f"data.train={data}", "data.max_seq_len=256",
        "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
        "model.scratch.max_position_embeddings=32", "trainer.max_steps=1", "trainer.batch_size=2",
        "logging.progress=none"])
    run_sft(config, tmp_path / "run")
    assert max(lengths) == 32 and min(lengths) < 32
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 of 2 examples are longer than the model's context of 32 tokens" in warnings[0]
    assert warnings[0].endswith("cut at 32, losing their ends and eos (the first: " f"{data}:2)")
    # A prompt past the context leaves no room for its completion: the error names the context, not
    # data.max_seq_len (256, which it fits).
    data.write_text(json.dumps({"prompt": "1+2=" * 10, "completion": "3"}) + "\n")
    with pytest.raises(DataError, match=r"sft.jsonl:1: prompt is 41 tokens, leaving no room for the completion "
                                        r"within max_len=32 \(the model's context, max_position_embeddings\)"):
        run_sft(config, tmp_path / "run2")
    # data.max_seq_len below the context cuts as silently as TRL's truncation would: warned the same way
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    short = config.model_copy(update={"data": config.data.model_copy(update={"max_seq_len": 16})})
    run_sft(short, tmp_path / "run3")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 of 2 examples are longer than data.max_seq_len=16 tokens: cut at 16" in warnings[0]


def test_final_checkpoint_keeps_the_sources_generation_config(tmp_path):
    """A model fine-tuned from a checkpoint whose generation_config.json lists its end-of-turn ids and
    sampling defaults: final/ carries them, so transformers' generate (and vLLM) stop where the source did."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tether.config import load_config
    from tether.recipes.sft import run_sft

    source = make_hf_checkpoint(tmp_path / "source", "qwen2")
    GenerationConfig(eos_token_id=[2, 3], do_sample=True, temperature=0.7, top_p=0.8).save_pretrained(source)
    config = load_config(None, ["recipe=sft", f"model.path={source}", "trainer.max_steps=1", "trainer.batch_size=2",
                                "data.num_train=8", "data.num_eval=4", "logging.progress=none"])
    final = run_sft(config, tmp_path / "run").final_dir
    generation = GenerationConfig.from_pretrained(final)
    assert (generation.eos_token_id, generation.do_sample, generation.temperature, generation.top_p) == \
        ([2, 3], True, 0.7, 0.8)
    assert AutoModelForCausalLM.from_pretrained(final).generation_config.eos_token_id == [2, 3]
