"""Model code: one decoder for Llama / Mistral / Qwen2 / Qwen3, Hugging Face checkpoint I/O, tokenizers."""

from tether.models.attention import AttentionBackend, CausalAttention, ContiguousKVCache, PackedAttention
from tether.models.checkpoint import load_model, read_model_config, save_checkpoint, save_model
from tether.models.config import ModelConfig, RopeScaling
from tether.models.decoder import Decoder
from tether.models.rope import RotaryEmbedding, apply_rope, compute_inv_freq
from tether.models.tokenizer import build_char_tokenizer, load_tokenizer

__all__ = [
    "AttentionBackend",
    "CausalAttention",
    "ContiguousKVCache",
    "Decoder",
    "ModelConfig",
    "PackedAttention",
    "RopeScaling",
    "RotaryEmbedding",
    "apply_rope",
    "build_char_tokenizer",
    "compute_inv_freq",
    "load_model",
    "load_tokenizer",
    "read_model_config",
    "save_checkpoint",
    "save_model",
]
