"""Tiny random Hugging Face checkpoints, built and saved by transformers itself.

``make_hf_checkpoint(tmp_path / "ckpt", "qwen3")`` writes ``config.json``, ``model.safetensors`` and
the character tokenizer, exactly as a user's ``save_pretrained`` would, so tests exercise the real
on-disk format rather than tether's own writer.

Weights are re-drawn with larger scales than transformers' init (std 0.02), whose logits are all
near zero: comparisons at 1e-4 would then pass for almost any bug.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tether.models.tokenizer import build_char_tokenizer

CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
FAMILIES = tuple(CONFIG_CLASSES)
_IS_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def make_hf_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 100,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool = False,
    bias: bool | None = None,
    qk_norm: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    **extra: Any,
) -> transformers.PretrainedConfig:
    """A transformers config for ``family``; ``extra`` overrides any config field."""
    if family not in CONFIG_CLASSES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if qk_norm is not None and qk_norm != (family == "qwen3"):
        raise ValueError(f"qk_norm={qk_norm} is not available for {family} (only qwen3 has q/k norms)")
    if bias and family == "mistral":
        raise ValueError("mistral has no attention bias")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family in ("llama", "qwen3") and bias is not None:
        kwargs["attention_bias"] = bias
    if family == "mistral":
        kwargs["sliding_window"] = None
    theta = extra.pop("rope_theta", 10000.0)
    if _IS_TRANSFORMERS_5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    else:
        kwargs["rope_theta"] = theta
        kwargs["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    kwargs.update(extra)
    return CONFIG_CLASSES[family](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Scales chosen so hidden states and logits are O(1) and differ clearly between tokens."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.2 * torch.randn(param.shape, generator=generator)
        elif name.endswith(".bias"):
            values = 0.2 * torch.randn(param.shape, generator=generator)
        elif "embed_tokens" in name:
            # also the output head when tied: logits = normed hidden . embedding, std ~ 2
            values = torch.randn(param.shape, generator=generator) * 2.0 / param.shape[-1] ** 0.5
        else:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
            values = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
        param.copy_(values)


def make_hf_model(family: str = "qwen2", *, seed: int = 0, **config_kwargs: Any) -> torch.nn.Module:
    """A random transformers ``*ForCausalLM`` in fp32 eval mode, eager attention."""
    config = make_hf_config(family, **config_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def make_hf_checkpoint(
    path: str | Path,
    family: str = "qwen2",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool = False,
    bias: bool | None = None,
    qk_norm: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    **extra: Any,
) -> Path:
    """Save a random ``family`` model (and the char tokenizer) with ``save_pretrained``; returns ``path``.

    ``vocab_size`` defaults to the char tokenizer's size (100), so its ids are valid model inputs.
    """
    tokenizer = build_char_tokenizer()
    model = make_hf_model(
        family,
        seed=seed,
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        tie=tie,
        bias=bias,
        qk_norm=qk_norm,
        rope_scaling=rope_scaling,
        **extra,
    )
    directory = Path(path)
    model.save_pretrained(directory, safe_serialization=True)
    if with_tokenizer:
        tokenizer.save_pretrained(directory)
    return directory


def load_tiny_model(path: str | Path, family: str = "qwen2", **kwargs: Any) -> torch.nn.Module:
    """``make_hf_checkpoint`` (no tokenizer) loaded as tether's ``Decoder`` in eval mode."""
    from tether.models import load_model

    return load_model(make_hf_checkpoint(path, family, with_tokenizer=False, **kwargs)).eval()
