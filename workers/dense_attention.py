"""Exact attention for one sequence with its own growing K/V (tests, perplexity, simple decoding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DenseCausalAttention"]


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
