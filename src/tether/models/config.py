"""``ModelConfig``: the decoder's architecture, read from and written to a Hugging Face ``config.json``.

One dense decoder covers four families; they differ only in a few switches:

=========  ===============  ==========  =======  ==========================================
family     q/k/v bias       o bias      qk norm  sliding window
=========  ===============  ==========  =======  ==========================================
llama      attention_bias   same        no       none
mistral    no               no          no       ``sliding_window`` on every layer
qwen2      always           never       no       ``use_sliding_window``: layers >= max_window_layers
qwen3      attention_bias   same        yes      as qwen2
=========  ===============  ==========  =======  ==========================================

Transformers 4.x writes ``rope_theta`` + ``rope_scaling`` (keyed ``type`` or ``rope_type``) and
``torch_dtype``; 5.x writes ``rope_parameters`` (holding ``rope_theta``) and ``dtype``. Both parse to
the same ``ModelConfig``, and ``to_hf`` writes both spellings so either major version loads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tether.errors import CheckpointError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Defaults of the transformers config classes, used when a key is absent from config.json.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_TOKEN_IDS = {"llama": (1, 2), "mistral": (1, 2), "qwen2": (None, None), "qwen3": (None, None)}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")  # fmt: skip
_SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A RoPE scaling variant, with the fields of transformers' ``rope_parameters`` it uses."""

    rope_type: str  # "linear" | "llama3" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn

    def to_hf(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__slots__}
        return {key: value for key, value in fields.items() if value is not None}


# Sizes a model cannot have zero or fewer of (a negative one would fail deep in tensor allocation).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # llama's ``mlp_bias``
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()  # indices of the layers that use ``sliding_window``
    max_window_layers: int | None = None  # qwen2/qwen3 only, kept for the round trip
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype_name: str | None = None  # the checkpoint's stored dtype ("bfloat16"), informational
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown keys, for the round trip

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_FAMILIES:
            raise CheckpointError(f"model_type {self.model_type!r} is not one of {SUPPORTED_FAMILIES}")
        for name in _POSITIVE_SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):  # NaN or inf would reach every logit, silently
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"{name} must be a finite number > 0, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in _SILU_NAMES:
            raise CheckpointError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.head_dim % 2 != 0:
            raise CheckpointError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window_layers and self.sliding_window is None:
            raise CheckpointError("sliding_window_layers is set but sliding_window is None")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def context_length(self) -> int:
        """Positions the model serves: ``max_position_embeddings``, or the context a yarn or linear
        RoPE scaling extends the original one to, as vLLM derives it (Qwen2.5's long-context recipe adds
        yarn factor 4 to a config of 32768 positions for 131072)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type not in ("yarn", "linear"):
            return self.max_position_embeddings
        original = scaling.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * scaling.factor))

    def window_for_layer(self, layer_idx: int) -> int | None:
        return self.sliding_window if layer_idx in self.sliding_window_layers else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a transformers ``config.json`` dict (4.x or 5.x layout); ``source`` names it in errors."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise CheckpointError(f"{source}: missing required key 'model_type'")
        if model_type not in SUPPORTED_FAMILIES:
            raise CheckpointError(f"{source}: model_type {model_type!r} is not one of {SUPPORTED_FAMILIES}")
        for key in _REQUIRED_KEYS:
            if hf.get(key) is None:
                raise CheckpointError(f"{source}: missing required key {key!r}")
        quantization = hf.get("quantization_config")
        if quantization:  # its tensors (qweight, scales) would fail one by one as unexpected
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
            raise CheckpointError(f"{source}: a quantized checkpoint (quantization_config, quant_method={method!r}) "
                                  "is not supported: use the unquantized weights (bfloat16 or float32)")
        known = _KNOWN_KEYS | set(_REQUIRED_KEYS)
        try:
            num_heads = _count(hf, "num_attention_heads")
            rope_theta, rope_scaling = _parse_rope(hf, source)
            bias = _parse_biases(model_type, hf)
            window, window_layers = _parse_sliding_window(model_type, hf)
            default_bos, default_eos = _DEFAULT_TOKEN_IDS[model_type]
            eos = hf.get("eos_token_id", default_eos)
            return cls(
                model_type=model_type,
                vocab_size=_count(hf, "vocab_size"),
                hidden_size=_count(hf, "hidden_size"),
                intermediate_size=_count(hf, "intermediate_size"),
                num_hidden_layers=_count(hf, "num_hidden_layers"),
                num_attention_heads=num_heads,
                num_key_value_heads=_count(hf, "num_key_value_heads", num_heads),
                head_dim=_parse_head_dim(model_type, hf, num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_count(hf, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]),
                tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
                qkv_bias=bias[0],
                o_bias=bias[1],
                mlp_bias=_flag(hf, "mlp_bias") if model_type == "llama" else False,
                qk_norm=model_type == "qwen3",
                sliding_window=window,
                sliding_window_layers=window_layers,
                max_window_layers=hf.get("max_window_layers") if model_type in ("qwen2", "qwen3") else None,
                hidden_act=str(hf.get("hidden_act", "silu")),
                bos_token_id=hf.get("bos_token_id", default_bos),
                eos_token_ids=_as_id_tuple(eos),
                pad_token_id=hf.get("pad_token_id"),
                dtype_name=hf.get("dtype") or hf.get("torch_dtype"),
                extra={key: value for key, value in hf.items() if key not in known},
            )
        except CheckpointError as error:
            message = str(error)
            raise CheckpointError(message if message.startswith(source) else f"{source}: {message}") from None
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError, ZeroDivisionError) as error:
            raise CheckpointError(f"{source}: bad value ({type(error).__name__}: {error})") from None

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4.x and 5.x both load into the same model."""
        hf: dict[str, Any] = dict(self.extra)
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        hf.update(
            architectures=[_ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            # 4.x reads rope_theta + rope_scaling; 5.x reads rope_parameters (and ignores the others).
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling.to_hf() if self.rope_scaling is not None else None,
            rope_parameters=rope_parameters,
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
        )
        hf.update(self._family_keys())
        if self.dtype_name is not None:
            hf["dtype"] = hf["torch_dtype"] = self.dtype_name
        return hf

    def _family_keys(self) -> dict[str, Any]:
        if self.model_type == "llama":
            return {"attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}
        if self.model_type == "mistral":
            return {"sliding_window": self.sliding_window}
        keys: dict[str, Any] = {
            "use_sliding_window": bool(self.sliding_window_layers),
            "sliding_window": self.sliding_window,
            "max_window_layers": self.max_window_layers
            if self.max_window_layers is not None
            else self.num_hidden_layers,
            "layer_types": [
                "sliding_attention" if i in self.sliding_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)
            ],
        }
        if self.model_type == "qwen3":
            keys["attention_bias"] = self.qkv_bias
        return keys


_KNOWN_KEYS = {
    "model_type", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "hidden_act",
    "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "architectures",
    "partial_rotary_factor",
}  # fmt: skip


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _parse_head_dim(model_type: str, hf: dict[str, Any], num_heads: int) -> int:
    if hf.get("head_dim") is not None:
        return int(hf["head_dim"])
    # Qwen3Config's head_dim defaults to 128, not hidden_size // heads.
    return 128 if model_type == "qwen3" else int(hf["hidden_size"]) // num_heads


def _parse_biases(model_type: str, hf: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) for the family."""
    if model_type == "qwen2":
        return True, False
    if model_type == "mistral":
        return False, False
    bias = bool(hf.get("attention_bias", False))
    return bias, bias


def _parse_sliding_window(model_type: str, hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    num_layers = int(hf["num_hidden_layers"])
    if model_type == "llama":
        return None, ()
    if model_type == "mistral":
        window = hf.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
        return (int(window), tuple(range(num_layers))) if window is not None else (None, ())
    window = hf.get("sliding_window", 4096)
    if not hf.get("use_sliding_window", False) or window is None:
        return None, ()
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    else:
        first = int(hf.get("max_window_layers", 28))
        layers = tuple(range(first, num_layers))
    return int(window), layers


def _count(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """A size or count of ``config.json``: an integer >= 1 (an integral float as JSON may write it);
    absent or null: ``default``. A string, a fraction or 0 is an error, not truncated or defaulted."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise CheckpointError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)


def _flag(hf: dict[str, Any], key: str) -> bool:
    """A true/false of ``config.json`` (absent or null: false); the string "false" is an error, not True."""
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(f"{key} must be true or false, got {value!r}")
    return value


def _parse_rope(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (5.x) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial_rotary_factor = params.get("partial_rotary_factor")
    if partial_rotary_factor is None:  # transformers: the rope dict's, else the top-level key's; null = absent
        partial_rotary_factor = hf.get("partial_rotary_factor")
    if partial_rotary_factor not in (None, 1.0):
        raise CheckpointError(f"{source}: partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if rope_type in ("linear", "llama3") and params.get("factor") is None:
        raise CheckpointError(f"{source}: rope scaling {rope_type!r} is missing required key 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if params.get(key) is None:
                raise CheckpointError(f"{source}: rope scaling 'llama3' is missing required key {key!r}")
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and hf.get("original_max_position_embeddings") is not None:
        # transformers gives a top-level key priority over the rope dict's (Phi-3-style configs)
        original = hf["original_max_position_embeddings"]
    if original is None and rope_type in ("llama3", "yarn"):
        # transformers falls back to max_position_embeddings, with the family's default.
        original = hf.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[hf["model_type"]]
    factor = params.get("factor")
    if factor is None:  # yarn without a factor: the context extension ratio, as transformers does
        factor = (hf.get("max_position_embeddings") or original) / original
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise CheckpointError(f"{source}: rope scaling factor must be a number > 0, got {factor!r}")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(original) if original is not None else None,
        low_freq_factor=_opt_float(params.get("low_freq_factor")),
        high_freq_factor=_opt_float(params.get("high_freq_factor")),
        attention_factor=_opt_float(params.get("attention_factor")),
        beta_fast=_opt_float(params.get("beta_fast")),
        beta_slow=_opt_float(params.get("beta_slow")),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        truncate=params.get("truncate"),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
