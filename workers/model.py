"""Our own Llama-family forward (RMSNorm, RoPE, GQA, SwiGLU). Attention is delegated to an `AttentionFn`.

The engine flattens the tokens of every sequence in a step into one batch of T rows and passes an
`AttentionFn` that owns the KV cache (it writes k/v and runs prefill/decode attention per layer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from chunkserve.workers.config import ModelConfig


class AttentionFn(Protocol):
    """Per-layer attention over the step's T rows; q and k arrive with RoPE applied."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D] -> o: [T, Hq, D]
        ...


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention scaling) for the config's RoPE type (default, linear, llama3)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    rtype = rs["rope_type"]
    if rtype == "linear":
        return inv_freq / float(rs["factor"]), 1.0
    if rtype == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rtype == "yarn":
        return _yarn_inv_freq(cfg, rs)
    raise NotImplementedError(f"RoPE scaling type {rtype!r} is not implemented")


def _yarn_inv_freq(cfg: ModelConfig, rs: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: ramped inv_freq blend + cos/sin attention factor."""
    d, base = cfg.head_dim, cfg.rope_theta
    orig = int(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = float(rs.get("factor") or cfg.max_position_embeddings / orig)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def corr_dim(rot: float) -> float:
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(float(rs.get("beta_fast") or 32)), corr_dim(float(rs.get("beta_slow") or 1))
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matmuls."""

    ln1: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [Hq*D + 2*Hkv*D, H]
    b_qkv: torch.Tensor | None  # [Hq*D + 2*Hkv*D]
    w_o: torch.Tensor  # [H, Hq*D]
    b_o: torch.Tensor | None  # [H]
    ln2: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2*I, H]
    b_gate_up: torch.Tensor | None  # [2*I]
    w_down: torch.Tensor  # [H, I]
    b_down: torch.Tensor | None  # [H]


class CausalLM:
    """A Llama-family decoder over flattened tokens. Build with `from_state_dict` or `random`."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H]; the same tensor as embed when tied
        self.dtype = embed.dtype
        self.device = embed.device
        inv_freq, scale = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2] fp32
        self._cos = (freqs.cos() * scale).to(device=self.device, dtype=self.dtype)  # [P, D/2]
        self._sin = (freqs.sin() * scale).to(device=self.device, dtype=self.dtype)  # [P, D/2]
        self._packed: list[tuple[torch.Tensor, ...]] | None = None  # oneDNN-blocked weights (see prepack)
        self._packed_head: torch.Tensor | None = None

    def prepack(self, batch_hint: int = 32) -> bool:
        """Reorder the matmul weights once into oneDNN's blocked layout (CPU fp32/bf16); returns whether.

        Plain `F.linear` re-packs the weight on every call; the packed form skips that (about 1.3x
        faster decode matmuls in bf16, 1.4x in fp32, lm_head 1.7x). bf16 results are bit-identical;
        fp32 ones differ from MKL's in the last bits (another summation order), like any other
        blocking. Costs one extra copy of the weights in memory.
        """
        if self._packed is not None:
            return True
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return False
        mkldnn = torch.ops.mkldnn
        if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
            return False
        if self.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
            return False

        def pack(w: torch.Tensor) -> torch.Tensor:
            return mkldnn._reorder_linear_weight(w, batch_hint)

        try:
            lw = self.layers[0]
            probe = torch.randn(3, lw.w_qkv.shape[1], generator=torch.Generator().manual_seed(0)).to(self.dtype)
            got, want = self._packed_linear(probe, pack(lw.w_qkv), lw.b_qkv), F.linear(probe, lw.w_qkv, lw.b_qkv)
            same = torch.equal(got, want) if self.dtype == torch.bfloat16 else torch.allclose(got, want, 1e-4, 1e-5)
            if not same:
                return False
            self._packed = [(pack(lw.w_qkv), pack(lw.w_o), pack(lw.w_gate_up), pack(lw.w_down)) for lw in self.layers]
            self._packed_head = pack(self.lm_head)
        except RuntimeError:  # an ATen build without these oneDNN ops
            self._packed = self._packed_head = None
            return False
        return True

    @staticmethod
    def _packed_linear(x: torch.Tensor, w_packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w_packed, b, "none", [], "")

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers, in the model dtype."""
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.embed.element_size()

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: Mapping[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
        """From Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...); fuses at load time."""
        prefix = "model." if "model.embed_tokens.weight" in sd else ""

        def get(name: str, optional: bool = False) -> torch.Tensor | None:
            key = name if name == "lm_head.weight" else prefix + name
            if key not in sd:
                if optional:
                    return None
                raise ValueError(f"checkpoint is missing tensor {key!r} required by {config.architecture}")
            return sd[key]

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat([t.to(dtype) for t in ts], dim=0)  # type: ignore[union-attr]

        layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            qb = config.qkv_bias
            layers.append(LayerWeights(
                ln1=put(get(f"layers.{i}.input_layernorm.weight")),
                w_qkv=put(cat(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"))),
                b_qkv=put(cat(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")) if qb else None),
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
        return cls(config, embed, layers, put(get("norm.weight")), lm_head)

    @classmethod
    def random(cls, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0, std: float = 0.02) -> CausalLM:
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
        return cls(config, embed, layers, ones(h), lm_head)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face names (unfused), e.g. to save a random model with `save_checkpoint`."""
        c = self.config
        sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            sd["lm_head.weight"] = self.lm_head
        for i, lw in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            sd[f"model.layers.{i}.input_layernorm.weight"] = lw.ln1
            sd[f"model.layers.{i}.post_attention_layernorm.weight"] = lw.ln2
            for name, t in zip(("q", "k", "v"), lw.w_qkv.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
                sd[a + f"{name}_proj.weight"] = t
            if lw.b_qkv is not None:
                for name, t in zip(("q", "k", "v"), lw.b_qkv.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
                    sd[a + f"{name}_proj.bias"] = t
            sd[a + "o_proj.weight"] = lw.w_o
            gate, up = lw.w_gate_up.chunk(2, dim=0)
            sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"] = gate, up
            sd[m + "down_proj.weight"] = lw.w_down
            if lw.b_o is not None:
                sd[a + "o_proj.bias"] = lw.b_o
            if lw.b_gate_up is not None and lw.b_down is not None:
                sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"] = lw.b_gate_up.chunk(2, dim=0)
                sd[m + "down_proj.bias"] = lw.b_down
        return {k: v.contiguous() for k, v in sd.items()}

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; computed in fp32 like transformers, then cast back before the weight multiply
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, Hx, D]; cos/sin: [T, 1, D/2]; rotate-half convention (first half / second half)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Run all layers over T flattened tokens; returns the final-normed hidden states [T, H].

        Positions are range-checked when they are on the CPU (no device sync otherwise; an out-of-range
        index then fails inside index_select)."""
        c = self.config
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be 1-D [T]; got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        t = input_ids.shape[0]
        if t and positions.device.type == "cpu" and int(positions.max()) >= c.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings "
                             f"{c.max_position_embeddings}")
        input_ids = input_ids.to(self.device)
        positions = positions.to(self.device)
        cos = self._cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        sin = self._sin.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qk_size = c.q_size + c.kv_size
        h = self.embed.index_select(0, input_ids)  # [T, H]
        packed = self._packed
        lin = self._packed_linear if packed is not None else F.linear
        for i, lw in enumerate(self.layers):
            w_qkv, w_o, w_gate_up, w_down = packed[i] if packed is not None else (
                lw.w_qkv, lw.w_o, lw.w_gate_up, lw.w_down)
            x = self._rms_norm(h, lw.ln1)
            qkv = lin(x, w_qkv, lw.b_qkv)  # [T, (Hq + 2*Hkv) * D]
            qk = self._rope(qkv[:, :qk_size].view(t, hq + hkv, d), cos, sin)  # q and k heads in one go
            # q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D] (strided views)
            o = attn(i, qk[:, :hq], qk[:, hq:], qkv[:, qk_size:].view(t, hkv, d))  # [T, Hq, D]
            h.add_(lin(o.reshape(t, c.q_size), w_o, lw.b_o))  # h is our own buffer: add in place
            x = self._rms_norm(h, lw.ln2)
            gate, up = lin(x, w_gate_up, lw.b_gate_up).chunk(2, dim=-1)  # views [T, I] x2
            h.add_(lin(F.silu(gate, inplace=True).mul_(up), w_down, lw.b_down))
        return self._rms_norm(h, self.norm)

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] (from `forward`) -> fp32 logits [n, V]."""
        if self._packed_head is not None:
            return self._packed_linear(hidden, self._packed_head, None).float()
        return F.linear(hidden, self.lm_head).float()


class DenseCausalAttention:
    """Exact attention for ONE sequence, with its own growing per-layer K/V (tests and simple decoding).

    Call `forward` with the whole prompt, then optionally one token at a time (positions continuing).
    """

    def __init__(self, num_layers: int, scale: float | None = None) -> None:
        self.scale = scale
        self.k: list[torch.Tensor | None] = [None] * num_layers  # each [S, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def reset(self) -> None:
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> o: [T, Hq, D]
        pk, pv = self.k[layer], self.v[layer]
        k = k if pk is None else torch.cat((pk, k))  # [S, Hkv, D]
        v = v if pv is None else torch.cat((pv, v))
        self.k[layer], self.v[layer] = k, v
        t, s = q.shape[0], k.shape[0]
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        mask = None
        if t != s:  # query i sits at position s - t + i and sees keys 0..s-t+i
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)  # [T, S]
        o = F.scaled_dot_product_attention(  # [Hq, T, D]
            q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(),
            attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=True)
        return o.transpose(0, 1).contiguous()
