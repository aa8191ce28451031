import pytest

from helpers.hf_tiny import make_hf_config
from tether.errors import CheckpointError
from tether.models.config import ModelConfig, RopeScaling

BASE_4X = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def hf_dict(family: str, **kwargs) -> dict:
    return make_hf_config(family, **kwargs).to_dict()


def test_4x_and_5x_layouts_parse_to_the_same_config():
    v4 = {**BASE_4X, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
          "rope_scaling": {"type": "linear", "factor": 2.0}}  # fmt: skip
    v5 = {**BASE_4X, "dtype": "bfloat16", "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 500000.0}}  # fmt: skip
    assert ModelConfig.from_hf(v4) == ModelConfig.from_hf(v5)
    config = ModelConfig.from_hf(v4)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert config.dtype_name == "bfloat16"
    assert config.head_dim == 16 and config.num_kv_groups == 2


def test_llama3_scaling_in_4x_layout_gets_original_length_and_factors():
    v4 = {**BASE_4X, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}  # fmt: skip
    scaling = ModelConfig.from_hf(v4).rope_scaling
    assert scaling == RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)


def test_yarn_without_original_length_falls_back_to_max_positions():
    v5 = {**BASE_4X, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    scaling = ModelConfig.from_hf(v5).rope_scaling
    assert scaling.original_max_position_embeddings == 512 and scaling.factor == 4.0


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 1e4},
])
def test_a_top_level_original_length_wins_as_in_transformers(rope):
    """Phi-3-style configs keep original_max_position_embeddings beside the rope dict; transformers
    gives that key priority over the dict's (standardize_rope_params)."""
    hf = {**BASE_4X, "original_max_position_embeddings": 64, "rope_parameters": rope}
    config = ModelConfig.from_hf(hf)
    assert config.rope_scaling.original_max_position_embeddings == 64
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_a_null_partial_rotary_factor_is_absent():
    config = ModelConfig.from_hf({**BASE_4X, "partial_rotary_factor": None})
    assert config.rope_scaling is None
    with pytest.raises(CheckpointError, match="partial_rotary_factor != 1 is not supported"):
        ModelConfig.from_hf({**BASE_4X, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_transformers_config_parses_and_round_trips(family):
    config = ModelConfig.from_hf(hf_dict(family, tie=True))
    assert config.model_type == family
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (100, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (1, (2,), 0)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_family_switches():
    assert (ModelConfig.from_hf(hf_dict("qwen2")).qkv_bias, ModelConfig.from_hf(hf_dict("qwen2")).o_bias) == (
        True,
        False,
    )
    llama = ModelConfig.from_hf(hf_dict("llama", bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
    qwen3 = ModelConfig.from_hf(hf_dict("qwen3"))
    assert qwen3.qk_norm and not qwen3.qkv_bias
    mistral = ModelConfig.from_hf(hf_dict("mistral", sliding_window=8))
    assert mistral.sliding_window == 8 and mistral.sliding_window_layers == (0, 1)
    assert not mistral.qkv_bias


def test_qwen_sliding_window_only_on_layers_from_max_window_layers():
    hf = hf_dict("qwen2", num_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    config = ModelConfig.from_hf(hf)
    assert config.sliding_window == 6 and config.sliding_window_layers == (1, 2)
    assert config.window_for_layer(0) is None and config.window_for_layer(2) == 6
    legacy = {key: value for key, value in hf.items() if key != "layer_types"}  # a 4.x config.json
    assert ModelConfig.from_hf(legacy).sliding_window_layers == (1, 2)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert ModelConfig.from_hf(hf_dict("qwen2", sliding_window=6)).sliding_window is None  # not enabled


def test_qwen3_head_dim_defaults_to_128_like_transformers():
    hf = {**BASE_4X, "model_type": "qwen3"}
    assert ModelConfig.from_hf(hf).head_dim == 128
    assert ModelConfig.from_hf(BASE_4X).head_dim == 16


def test_list_of_eos_ids_round_trips():
    config = ModelConfig.from_hf({**BASE_4X, "eos_token_id": [2, 7]})
    assert config.eos_token_ids == (2, 7)
    assert config.to_hf()["eos_token_id"] == [2, 7]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"model_type": None}, "'model_type'"),
        ({"hidden_size": None}, "'hidden_size'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"num_attention_heads": "four"}, "num_attention_heads must be an integer >= 1, got 'four'"),
        ({"vocab_size": 100.7}, "vocab_size must be an integer >= 1, got 100.7"),  # was cut to 100
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1, got 0"),  # was a default
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),  # was True
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope scaling factor must be a number > 0"),
        ({"rope_theta": "big"}, "bad value"),
        ({"rope_parameters": [1, 2], "rope_theta": None}, "bad value"),
        ({"model_type": "qwen2", "sliding_window": "x", "use_sliding_window": True}, "bad value"),
    ],
)
def test_bad_config_raises_one_line_checkpoint_error_naming_file_and_key(change, needle):
    hf = {**BASE_4X, **change}
    hf = {key: value for key, value in hf.items() if value is not None}
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_hf(hf, source="/ckpt/config.json")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("/ckpt/config.json: ")
    assert needle in message


def test_a_quantized_checkpoint_is_refused_up_front():
    """Its qweight/scales tensors failed one by one as "unexpected tensor" for the architecture."""
    hf = {**hf_dict("qwen2"), "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(CheckpointError, match=r"c.json: a quantized checkpoint \(quantization_config, "
                                              r"quant_method='gptq'\) is not supported"):
        ModelConfig.from_hf(hf, source="c.json")
