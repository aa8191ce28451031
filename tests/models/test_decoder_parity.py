"""tether's Decoder against transformers' own model on the same tiny random checkpoint (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.hf_tiny import make_hf_checkpoint
from tether.models import Decoder, load_model

ATOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "factor": 2.0}

CASES = [
    ("llama", dict(num_heads=4, num_kv_heads=4)),  # GQA ratio 1
    ("llama", dict(num_heads=4, num_kv_heads=2, tie=True, bias=True)),
    ("llama", dict(num_heads=4, num_kv_heads=1, rope_scaling=LLAMA3)),  # GQA ratio 4
    ("mistral", dict(num_heads=4, num_kv_heads=2)),
    ("mistral", dict(hidden_size=32, num_heads=2, num_kv_heads=1, rope_scaling=LINEAR)),
    ("qwen2", dict(num_heads=4, num_kv_heads=2)),  # q/k/v bias, no o bias
    ("qwen2", dict(num_heads=4, num_kv_heads=1, tie=True, rope_scaling=YARN)),
    ("qwen3", dict(num_heads=4, num_kv_heads=2)),  # q/k norm
    ("qwen3", dict(num_heads=4, num_kv_heads=4, bias=True, tie=True, rope_scaling=YARN)),
    ("qwen3", dict(hidden_size=32, num_heads=4, num_kv_heads=1, head_dim=16)),  # head_dim != hidden/heads
]


def case_id(case):
    family, kwargs = case
    values = {k: v["rope_type"] if isinstance(v, dict) else v for k, v in kwargs.items()}
    return family + "-" + "-".join(f"{k}={v}" for k, v in values.items())


def load_pair(path, attn_implementation="eager"):
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation).eval()
    return hf, load_model(path).eval()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_logits_match_transformers(tmp_path, case):
    family, kwargs = case
    path = make_hf_checkpoint(tmp_path, family, with_tokenizer=False, **kwargs)
    hf, ours = load_pair(path)
    input_ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids).logits
        logits = ours.compute_logits(ours(input_ids))
    assert expected.std() > 0.5  # the check below is meaningful
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_explicit_positions_match_transformers_position_ids(tmp_path):
    path = make_hf_checkpoint(tmp_path, "qwen3", with_tokenizer=False, rope_scaling=YARN)
    hf, ours = load_pair(path, attn_implementation="sdpa")
    input_ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    # an offset per row, and a gap after the 5th token (RoPE is relative: an offset alone changes nothing)
    positions = torch.arange(10).expand(2, 10) + torch.tensor([[7], [40]]) + 9 * (torch.arange(10) >= 5)
    with torch.no_grad():
        expected = hf(input_ids, position_ids=positions).logits
        logits = ours.compute_logits(ours(input_ids, positions=positions))
        unshifted = ours.compute_logits(ours(input_ids))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert (logits - unshifted).abs().max() > 1e-2  # the gap really reaches the attention


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_matches_transformers(tmp_path, family):
    if family == "mistral":
        extra = dict(sliding_window=4)
    else:  # only layers >= max_window_layers slide
        extra = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    path = make_hf_checkpoint(tmp_path, family, with_tokenizer=False, **extra)
    hf, ours = load_pair(path)
    assert ours.config.sliding_window == 4
    input_ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(input_ids).logits
        logits = ours.compute_logits(ours(input_ids))
        full = ours.compute_logits(ours(input_ids, attn=ours.default_attention().__class__()))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert (logits - full).abs().max() > 1e-3  # the window changed the result


def test_parameter_names_and_shapes_equal_transformers(tmp_path):
    path = make_hf_checkpoint(tmp_path, "qwen3", with_tokenizer=False, bias=True)
    hf, ours = load_pair(path)
    hf_shapes = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    our_shapes = {name: tuple(t.shape) for name, t in ours.state_dict().items()}
    assert our_shapes == hf_shapes


def test_tied_head_shares_the_embedding_tensor(tmp_path):
    path = make_hf_checkpoint(tmp_path, "qwen2", with_tokenizer=False, tie=True)
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))  # counted once


def test_gradients_match_transformers(tmp_path):
    path = make_hf_checkpoint(tmp_path, "qwen3", with_tokenizer=False, tie=True, num_kv_heads=1)
    hf, ours = load_pair(path)
    input_ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(4))
    hf(input_ids).logits.logsumexp(-1).sum().backward()
    ours.compute_logits(ours(input_ids)).logsumexp(-1).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name].grad, atol=1e-4, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    path = make_hf_checkpoint(tmp_path, "llama", with_tokenizer=False)
    input_ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    grads = []
    for is_enabled in (False, True):
        model = load_model(path).train()
        model.set_gradient_checkpointing(is_enabled)
        model.compute_logits(model(input_ids)).logsumexp(-1).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed)


def test_bf16_model_runs_and_stays_close_to_fp32(tmp_path):
    path = make_hf_checkpoint(tmp_path, "llama", with_tokenizer=False)
    fp32, bf16 = load_model(path), load_model(path, dtype=torch.bfloat16)
    assert isinstance(bf16, Decoder) and bf16.lm_head.weight.dtype == torch.bfloat16
    input_ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        reference = fp32.compute_logits(fp32(input_ids))
        low = bf16.compute_logits(bf16(input_ids))
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max() < 0.25
