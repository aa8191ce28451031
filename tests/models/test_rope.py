import math

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from helpers.hf_tiny import make_hf_config
from tether.models.config import ModelConfig
from tether.models.rope import RotaryEmbedding, apply_rope, compute_inv_freq, default_inv_freq, rotate_half

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "truncate": False},
}  # fmt: skip


def test_default_inv_freq_by_hand():
    # theta=100, D=4: 100^(-0/4), 100^(-2/4)
    assert torch.allclose(default_inv_freq(4, 100.0), torch.tensor([1.0, 0.1]))


def test_rotate_half_by_hand():
    assert rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_apply_rope_rotates_pairs_by_position_times_frequency():
    # D=2, inv_freq=[1]: (x0, x1) at position p is rotated by p radians
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 2, "intermediate_size": 4,
          "num_hidden_layers": 1, "num_attention_heads": 1}  # fmt: skip
    config = ModelConfig.from_hf(hf)
    cos, sin = RotaryEmbedding(config)(torch.tensor([[0, 1, 2]]), torch.float32)
    q = torch.tensor([1.0, 0.0]).expand(1, 3, 1, 2)
    q_rot, _ = apply_rope(q, q, cos, sin)
    expected = torch.tensor([[math.cos(p), math.sin(p)] for p in range(3)])
    assert torch.allclose(q_rot[0, :, 0], expected, atol=1e-6)


@pytest.mark.parametrize("name", [None, *SCALINGS])
def test_inv_freq_and_attention_scaling_match_transformers(name):
    scaling = SCALINGS.get(name)
    hf_config = make_hf_config("llama", hidden_size=128, num_heads=2, rope_scaling=scaling, rope_theta=5e4)
    config = ModelConfig.from_hf(hf_config.to_dict())
    inv_freq, attention_scaling = compute_inv_freq(config)
    if name is None:
        expected = default_inv_freq(64, 5e4)
        expected_scaling = 1.0
    else:
        expected, expected_scaling = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    assert inv_freq.shape == (32,)
    assert torch.equal(inv_freq, expected.float())
    assert attention_scaling == pytest.approx(expected_scaling, rel=1e-12)
    if name is not None:
        assert not torch.equal(inv_freq, default_inv_freq(64, 5e4))  # the scaling did something


@pytest.mark.parametrize("name", ["yarn", "llama3"])
def test_cos_sin_match_transformers_rotary_module(name):
    hf_config = make_hf_config("llama", hidden_size=64, num_heads=2, rope_scaling=SCALINGS[name])
    config = ModelConfig.from_hf(hf_config.to_dict())
    positions = torch.tensor([[0, 1, 2, 3, 200], [0, 1, 0, 1, 2]])  # second row: two packed sequences
    x = torch.zeros(1)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(x, positions)
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    q, k = torch.randn(2, 5, 4, 32), torch.randn(2, 5, 2, 32)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
    our_q, our_k = apply_rope(q, k, cos, sin)
    assert torch.allclose(our_q, hf_q.transpose(1, 2), atol=1e-6)
    assert torch.allclose(our_k, hf_k.transpose(1, 2), atol=1e-6)


def test_rotary_stays_fp32_and_casts_output():
    config = ModelConfig.from_hf(make_hf_config("qwen2").to_dict())
    rotary = RotaryEmbedding(config)
    cos, sin = rotary(torch.tensor([[5, 6]]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert rotary.inv_freq(torch.device("cpu")).dtype == torch.float32
