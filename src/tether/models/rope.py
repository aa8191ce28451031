"""Rotary position embeddings (RoPE), with the scaling variants of ``transformers.modeling_rope_utils``.

Each variant maps (head_dim, theta, scaling) to ``inv_freq [D/2]`` and an ``attention_scaling`` that
multiplies cos and sin (only YaRN's is not 1). The formulas follow transformers 5.x exactly so that
logits match a transformers model to fp32 rounding:

* linear  -- position interpolation: ``inv_freq / factor``.
* llama3  -- wavelengths above ``original / low_freq_factor`` are divided by ``factor``, those below
             ``original / high_freq_factor`` are kept, the band between is interpolated smoothly.
* yarn    -- "YaRN: Efficient Context Window Extension" (Peng et al., 2023), eq. 18-20: blend of
             interpolated and extrapolated frequencies by a linear ramp over dimensions, and an
             attention factor ``0.1 ln(factor) + 1`` (or the mscale ratio).

cos/sin are computed from explicit integer positions ``[B, T]`` on every forward rather than looked
up in a precomputed table: a table indexed by position needs its length (a host sync on the maximum
position) and the product ``position * inv_freq`` in fp32 is what transformers computes, so results
are bit-identical to its rotary module.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tether.models.config import ModelConfig, RopeScaling


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/D): ``[D/2]`` fp32, computed as transformers does (int64 arange)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _linear(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    return default_inv_freq(head_dim, theta) / scaling.factor, 1.0


def _llama3(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    inv_freq = default_inv_freq(head_dim, theta)
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    assert low is not None and high is not None and old_context_len is not None  # checked by the config
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    original = scaling.original_max_position_embeddings
    assert original is not None  # filled in by the config parser
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            numerator = _yarn_mscale(factor, scaling.mscale)
            attention_factor = numerator / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits num_rotations times into the original context
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp, as transformers does
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    extrapolation_weight = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


_SCALED_INV_FREQ: dict[str, Callable[[int, float, RopeScaling], tuple[torch.Tensor, float]]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq ``[head_dim / 2]`` fp32 on CPU, attention_scaling applied to cos and sin).

    Always on CPU, even inside a ``torch.device("meta")`` context (checkpoint loading builds the
    model there): inv_freq is computed, never loaded."""
    if config.rope_scaling is None:
        return default_inv_freq(config.head_dim, config.rope_theta), 1.0
    variant = _SCALED_INV_FREQ[config.rope_scaling.rope_type]
    return variant(config.head_dim, config.rope_theta, config.rope_scaling)


class RotaryEmbedding:
    """cos/sin for explicit positions. Not an ``nn.Module`` on purpose: inv_freq must stay fp32 when
    the model is cast to bf16, and it is not part of the checkpoint (transformers does not save it)."""

    __slots__ = ("attention_scaling", "_inv_freq_by_device")

    def __init__(self, config: ModelConfig) -> None:
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {inv_freq.device: inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            cpu = self._inv_freq_by_device[torch.device("cpu")]
            self._inv_freq_by_device[device] = cpu.to(device)
        return self._inv_freq_by_device[device]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[B, T]`` int -> cos, sin ``[B, T, D]`` in ``dtype`` (computed in fp32, as HF)."""
        inv_freq = self.inv_freq(positions.device)
        freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]: HF's rotate-half layout
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]``, cos/sin ``[B, T, D]`` -> rotated q, k (same shapes)."""
    cos = cos.unsqueeze(2)  # [B, T, 1, D], broadcast over heads
    sin = sin.unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
