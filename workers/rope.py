"""RoPE inverse frequencies for the config's scaling type (default, linear, llama3, yarn), as transformers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from chunkserve.workers.config import ModelConfig


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
