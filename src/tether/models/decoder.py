"""``Decoder``: one dense pre-norm decoder for Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Parameter names equal transformers' (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``,
...) so ``state_dict()`` maps 1:1 onto Hugging Face safetensors and onto engine weight updates.
With tied embeddings ``lm_head.weight`` *is* ``model.embed_tokens.weight`` (one tensor, two names).

The forward stops at the final norm: ``compute_logits`` projects only the positions a caller needs,
because on CPU the vocabulary projection dominates the cost of a small model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tether.models.attention import AttentionBackend, CausalAttention, sliding_window_args
from tether.models.config import ModelConfig
from tether.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale: the order transformers uses (matters in bf16)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An engine serving a step may swap in its own ``silu(gate) * up`` (``_silu_mul``: the compiled
        # kernel, see ``tether.engine.runner``); any other forward uses ``F.silu``.
        silu_mul = self.__dict__.get("_silu_mul")
        if silu_mul is not None:
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.is_qk_norm = config.qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        batch, num_tokens, _ = x.shape  # x: [B, T, hidden]
        q = self.q_proj(x).view(batch, num_tokens, -1, self.head_dim)  # [B, T, Hq, D]
        k = self.k_proj(x).view(batch, num_tokens, -1, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(batch, num_tokens, -1, self.head_dim)  # [B, T, Hkv, D]
        if self.is_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos, sin)
        out = attn.attend(self.layer_idx, q, k, v)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(batch, num_tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """transformers' ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # padding_idx as transformers sets it: the pad row gets no gradient through the input embedding
        pad = config.pad_token_id
        padding_idx = pad if pad is not None and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        self.is_gradient_checkpointing = False

    def default_attention(self, key_padding_mask: torch.Tensor | None = None) -> CausalAttention:
        """Full causal attention with the checkpoint's sliding window, if it has one."""
        return CausalAttention(key_padding_mask=key_padding_mask, **sliding_window_args(self.config))

    def set_gradient_checkpointing(self, is_enabled: bool) -> None:
        """Recompute each layer in backward instead of storing its activations (training only)."""
        self.is_gradient_checkpointing = is_enabled

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """input_ids ``[B, T]``, positions ``[B, T]`` (default 0..T-1 per row) -> hidden ``[B, T, hidden]``
        after the final norm. ``attn`` None means full causal attention without padding."""
        if attn is None:
            attn = self.default_attention()
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [B, T, D], shared by all layers
        is_recomputed = self.is_gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if is_recomputed:
                x = checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[..., hidden]`` -> logits ``[..., vocab]`` (in the model's dtype)."""
        return self.lm_head(hidden)
