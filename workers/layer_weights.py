"""A decoder layer's weights as the model runs them (q/k/v and gate/up fused), and their mapping to and from
Hugging Face's names: the checkpoint layout concern of `CausalLM` (`from_state_dict`, `random`, `state_dict`).

Each builder returns ``(embed, layers, norm, lm_head)``, the arguments `CausalLM` is made from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from chunkserve.workers.config import ModelConfig
from chunkserve.workers.linear import Int8Weight
from chunkserve.workers.quant import BlockWeight

Weight = torch.Tensor | Int8Weight | BlockWeight  # a matmul weight: dense in the model dtype, or quantised
Parts = tuple[torch.Tensor, list["LayerWeights"], torch.Tensor, Weight]  # (embed, layers, norm, lm_head)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matmuls (concatenated at load)."""

    ln1: torch.Tensor  # [H]
    w_qkv: Weight  # [Hq*D + 2*Hkv*D, H]
    b_qkv: torch.Tensor | None  # [Hq*D + 2*Hkv*D]
    w_o: Weight  # [H, Hq*D]
    b_o: torch.Tensor | None  # [H]
    ln2: torch.Tensor  # [H]
    w_gate_up: Weight  # [2*I, H]
    b_gate_up: torch.Tensor | None  # [2*I]
    w_down: Weight  # [H, I]
    b_down: torch.Tensor | None  # [H]

    def matmuls(self) -> tuple[tuple[Weight, torch.Tensor | None], ...]:
        """(weight, bias) of qkv, o, gate_up, down, in the order the layer runs them."""
        return ((self.w_qkv, self.b_qkv), (self.w_o, self.b_o), (self.w_gate_up, self.b_gate_up),
                (self.w_down, self.b_down))


def layers_from_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   device: str | torch.device) -> Parts:
    """Fused weights from Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...)."""
    prefix = "model." if "model.embed_tokens.weight" in sd else ""

    def get(name: str) -> torch.Tensor:
        key = name if name == "lm_head.weight" else prefix + name
        if key not in sd:
            raise ValueError(f"checkpoint is missing tensor {key!r} required by {config.architecture}")
        return sd[key]

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def cat(*ts: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.to(dtype) for t in ts], dim=0)

    layers: list[LayerWeights] = []
    for i in range(config.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        qb = config.qkv_bias
        layers.append(LayerWeights(
            ln1=put(get(f"layers.{i}.input_layernorm.weight")),
            w_qkv=put(cat(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"))),
            b_qkv=put(cat(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"))) if qb else None,
            w_o=put(get(a + "o_proj.weight")),
            b_o=put(get(a + "o_proj.bias")) if config.o_bias else None,
            ln2=put(get(f"layers.{i}.post_attention_layernorm.weight")),
            w_gate_up=put(cat(get(m + "gate_proj.weight"), get(m + "up_proj.weight"))),
            b_gate_up=put(cat(get(m + "gate_proj.bias"), get(m + "up_proj.bias"))) if config.mlp_bias else None,
            w_down=put(get(m + "down_proj.weight")),
            b_down=put(get(m + "down_proj.bias")) if config.mlp_bias else None,
        ))
    embed = put(get("embed_tokens.weight"))
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise ValueError(f"embed_tokens has shape {tuple(embed.shape)}, config expects "
                         f"({config.vocab_size}, {config.hidden_size})")
    head = sd.get("lm_head.weight")
    if config.tie_word_embeddings or head is None:
        if not config.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = put(head)
    return embed, layers, put(get("norm.weight")), lm_head


def random_layers(config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int,
                  std: float) -> Parts:
    """Random weights (normal(0, std), norms = 1) generated directly on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    layers = [LayerWeights(
        ln1=ones(h), w_qkv=rnd(q + 2 * kv, h), b_qkv=rnd(q + 2 * kv) if config.qkv_bias else None,
        w_o=rnd(h, q), b_o=rnd(h) if config.o_bias else None, ln2=ones(h),
        w_gate_up=rnd(2 * inter, h), b_gate_up=rnd(2 * inter) if config.mlp_bias else None,
        w_down=rnd(h, inter), b_down=rnd(h) if config.mlp_bias else None,
    ) for _ in range(config.num_layers)]
    embed = rnd(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else rnd(config.vocab_size, h)
    return embed, layers, ones(h), lm_head


def layers_to_hf(c: ModelConfig, parts: Parts, dense: Callable[[Weight], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names (unfused) of `parts`; `dense` turns a (quantised) weight into the values used."""
    embed, layers, norm, lm_head = parts
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "model.norm.weight": norm}
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = dense(lm_head)
    for i, lw in enumerate(layers):
        w_qkv, w_o = dense(lw.w_qkv), dense(lw.w_o)
        w_gate_up, w_down = dense(lw.w_gate_up), dense(lw.w_down)
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sd[f"model.layers.{i}.input_layernorm.weight"] = lw.ln1
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = lw.ln2
        for name, t in zip(("q", "k", "v"), w_qkv.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
            sd[a + f"{name}_proj.weight"] = t
        if lw.b_qkv is not None:
            for name, t in zip(("q", "k", "v"), lw.b_qkv.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
                sd[a + f"{name}_proj.bias"] = t
        sd[a + "o_proj.weight"] = w_o
        gate, up = w_gate_up.chunk(2, dim=0)
        sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"] = gate, up
        sd[m + "down_proj.weight"] = w_down
        if lw.b_o is not None:
            sd[a + "o_proj.bias"] = lw.b_o
        if lw.b_gate_up is not None and lw.b_down is not None:
            sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"] = lw.b_gate_up.chunk(2, dim=0)
            sd[m + "down_proj.bias"] = lw.b_down
    return {k: v.contiguous() for k, v in sd.items()}
