"""`ModelConfig`: the shape of a Llama-family decoder, parsed from Hugging Face configs or presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# model_type -> architecture class name; all share the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward needs. Validates itself; raises ValueError on inconsistent shapes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # Qwen2: True; Llama with attention_bias: True
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral; the engine must not exceed it (see max_model_len)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")
        if self.architecture not in SUPPORTED_MODEL_TYPES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {sorted(SUPPORTED_MODEL_TYPES.values())}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rtype = rs.get("rope_type", rs.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise NotImplementedError(f"RoPE scaling type {rtype!r} is not implemented "
                                          f"(supported: {SUPPORTED_ROPE_TYPES})")
            rs.pop("type", None)
            rs.pop("rope_theta", None)
            rs["rope_type"] = rtype
            if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
                raise NotImplementedError("partial_rotary_factor != 1 is not implemented")
            object.__setattr__(self, "rope_scaling", None if rtype == "default" else rs)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids as a tuple (empty when the model has none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def max_model_len(self) -> int:
        """Longest context the forward handles exactly (sliding window not implemented)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (lm_head counted once when tied)."""
        h, i, l_ = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l_ * per_layer + emb + h

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Our own field names, or a Hugging Face config dict (detected by `model_type`/`architectures`)."""
        if "model_type" in d or "architectures" in d or "num_hidden_layers" in d:
            return cls.from_hf(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        return cls(**dict(d))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """From a transformers `PretrainedConfig` or its dict (config.json). Non-Llama models raise ValueError."""
        if isinstance(hf, Mapping):
            hf = _hf_config_from_dict(hf)
        model_type = getattr(hf, "model_type", None)
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: chunkserve runs Llama-family decoders "
                             f"({', '.join(SUPPORTED_MODEL_TYPES)})")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; the SwiGLU MLP needs 'silu'")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        theta, scaling = _rope_from_hf(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding = _sliding_window(hf, model_type)
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=getattr(hf, "bos_token_id", None), eos_token_id=getattr(hf, "eos_token_id", None),
            architecture=SUPPORTED_MODEL_TYPES[model_type],
            qkv_bias=model_type == "qwen2" or attention_bias, o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)), sliding_window=sliding,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers loads as the matching `*ForCausalLM`."""
        model_type = next(k for k, v in SUPPORTED_MODEL_TYPES.items() if v == self.architecture)
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_parameters": rope,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if model_type == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = self.mlp_bias
        if model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        return d


def _sliding_window(hf: Any, model_type: str) -> int | None:
    """The attention window when a layer uses one (the engine attends to the whole context, so `max_model_len`
    is capped at it, where the two agree): Mistral's ``sliding_window``; Qwen2's ``layer_types`` entries of
    ``sliding_attention`` (or, in older configs, ``use_sliding_window`` past ``max_window_layers``)."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return None
    if model_type == "mistral":
        return int(window)
    types = getattr(hf, "layer_types", None)
    if types:
        return int(window) if "sliding_attention" in types else None
    used = getattr(hf, "use_sliding_window", False) and getattr(hf, "max_window_layers", 0) < hf.num_hidden_layers
    return int(window) if used else None


def _hf_config_from_dict(d: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        archs = d.get("architectures")
        raise ValueError(f"unsupported model_type {model_type!r} (architectures={archs}): chunkserve runs "
                         f"Llama-family decoders ({', '.join(SUPPORTED_MODEL_TYPES)})")
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    return AutoConfig.for_model(model_type, **kwargs)


def _rope_from_hf(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        rs = dict(params)
        theta = float(rs.pop("rope_theta"))
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0))
        rs = dict(getattr(hf, "rope_scaling", None) or {})
    rtype = rs.get("rope_type", rs.get("type", "default"))
    return theta, (None if rtype == "default" else rs)


def preset_config(name: str) -> ModelConfig:
    """Named shapes for random-weight models: llama-7b, llama3-8b, smollm2-135m, tiny."""
    presets: dict[str, dict[str, Any]] = {
        "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                         num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
                         max_position_embeddings=4096),
        "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                          num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          max_position_embeddings=131072, bos_token_id=128000, eos_token_id=(128001, 128009)),
        "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                             num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                             max_position_embeddings=8192, tie_word_embeddings=True),
        "tiny": dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True),
    }
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(presets)}")
    return ModelConfig(**presets[name])
