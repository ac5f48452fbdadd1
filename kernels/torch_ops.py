"""Building blocks shared by the PyTorch attention backends: partial attention and online-softmax merging.

A *partial* is ``(o, lse)``: the softmax-normalised output over a subset of keys and the log-sum-exp of
its scaled logits, both fp32. This is the paper's ``(o, m, n)`` triple with ``o/n`` stored and
``m + log n`` folded into one number; merging two partials is the paper's ``attn_reduce``.

On CPUs the partial comes from ATen's flash-attention kernel (it returns the log-sum-exp, is
blocked for the caches and runs on all threads); elsewhere from batched matmuls. Non-fp32 K/V are
up-cast to fp32 tile by tile, so a bf16/fp16 result is rounded once, at the very end.
"""

from __future__ import annotations

import torch

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
UPCAST_TILE_BYTES = 16 << 20  # fp32 bytes of K (and again of V) converted per tile when up-casting


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of fp32 queries over keys ``k``/``v`` (any float dtype), returning fp32 ``(o, lse)``.

    q: [B, H, M, D] fp32; k, v: [B, H, T, D] (may be strided views); bias: additive fp32 mask
    broadcastable to [B, H, M, T] (``-inf`` drops a key) or None. -> o: [B, H, M, D], lse: [B, H, M].
    """
    if k.dtype != torch.float32:
        return _partial_upcast(q, k, v, scale, bias)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        o, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return o, lse
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, H, M, T]
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    o = torch.matmul(p, v) / l
    lse = (m_safe + torch.log(l)).squeeze(-1)
    return o, lse


def _partial_upcast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-cast K/V to fp32 in token tiles that stay in cache, merging the tiles' partials."""
    b, h, t, d = k.shape
    tile = max(16, UPCAST_TILE_BYTES // max(1, b * h * d * 4))
    if tile >= t:
        return partial_attention(q, k.float(), v.float(), scale, bias)
    o_acc: torch.Tensor | None = None
    lse_acc: torch.Tensor | None = None
    for t0 in range(0, t, tile):
        t1 = min(t, t0 + tile)
        bias_t = None if bias is None else bias[..., t0:t1]
        o, lse = partial_attention(q, k[:, :, t0:t1].float(), v[:, :, t0:t1].float(), scale, bias_t)
        if o_acc is None or lse_acc is None:
            o_acc, lse_acc = o, lse
        else:
            merge_into(o_acc, lse_acc, o, lse)
    assert o_acc is not None and lse_acc is not None
    return o_acc, lse_acc


def merge_into(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (o_acc, lse_acc) <- attn_reduce((o_acc, lse_acc), (o, lse)); ``-inf`` lse = empty.

    o_acc, o: [..., D] fp32; lse_acc, lse: [...] fp32 (same leading shape).
    """
    m = torch.maximum(lse_acc, lse)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_acc = torch.exp(lse_acc - m)
    w_new = torch.exp(lse - m)
    tot = w_acc + w_new
    inv = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot))
    o_acc.mul_((w_acc * inv).unsqueeze(-1)).add_(o * (w_new * inv).unsqueeze(-1))
    lse_acc.copy_(m + torch.log(tot))


def dense_chunk_pass(
    q4: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    table: torch.Tensor,
    tokens: torch.Tensor,
    counts: list[int],
    o_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    scale: float,
    group_bytes: int = 64 << 20,
) -> None:
    """Attend each row over its chunk list, merging into the accumulators; loops over chunk positions.

    q4: [b, Hkv, g, D] fp32; k/v_pool_l: [Hkv, N, c, D]; table, tokens: [b, P] chunk ids / valid
    tokens (padding has 0 tokens); counts: host list, chunks per row; o_acc: [b, Hkv, g, D];
    lse_acc: [b, Hkv, g]. Chunk positions are processed ``G`` at a time: the chunks of all rows still
    active at those positions are gathered into one buffer (one index_select per position group)
    and attended with one batched call. Invalid slots are zeroed in the buffer and masked, so NaN
    in free pool slots cannot leak.
    """
    b, hkv, g, d = q4.shape
    c = k_pool_l.shape[2]
    p_max = max(counts, default=0)
    if p_max == 0:
        return
    per_pos = 2 * b * hkv * c * d * k_pool_l.element_size()
    group = max(1, min(p_max, group_bytes // max(1, per_pos)))
    counts_t = torch.tensor(counts, dtype=torch.int64)
    ar = torch.arange(c, device=tokens.device)
    for p0 in range(0, p_max, group):
        p1 = min(p_max, p0 + group)
        gsz = p1 - p0
        active = torch.nonzero(counts_t > p0).flatten()
        n_act = int(active.numel())
        if n_act == b:
            ids = table[:, p0:p1]
            tok = tokens[:, p0:p1]
            q_a = q4
        else:
            rows = active.to(table.device)
            ids = table.index_select(0, rows)[:, p0:p1]
            tok = tokens.index_select(0, rows)[:, p0:p1]
            q_a = q4.index_select(0, rows)
        flat_ids = ids.reshape(-1).to(torch.int64)
        kb = k_pool_l.index_select(1, flat_ids)  # [Hkv, n_act*gsz, c, D]
        vb = v_pool_l.index_select(1, flat_ids)
        valid = ar[None, None, :] < tok[:, :, None]  # [n_act, gsz, c]
        partial = bool((tok < c).any())
        bias = None
        if partial:
            bad = (~valid).reshape(1, n_act * gsz, c, 1)
            kb.masked_fill_(bad, 0.0)
            vb.masked_fill_(bad, 0.0)
            bias = torch.zeros(n_act, 1, 1, gsz * c, dtype=torch.float32, device=q4.device)
            bias.masked_fill_(~valid.reshape(n_act, 1, 1, gsz * c), float("-inf"))
        kv_shape = (hkv, n_act, gsz * c, d)
        o, lse = partial_attention(
            q_a,
            kb.view(kv_shape).permute(1, 0, 2, 3),
            vb.view(kv_shape).permute(1, 0, 2, 3),
            scale,
            bias,
        )
        if n_act == b:
            merge_into(o_acc, lse_acc, o, lse)
        else:
            o_sub, lse_sub = o_acc.index_select(0, rows), lse_acc.index_select(0, rows)
            merge_into(o_sub, lse_sub, o, lse)
            o_acc.index_copy_(0, rows, o_sub)
            lse_acc.index_copy_(0, rows, lse_sub)
