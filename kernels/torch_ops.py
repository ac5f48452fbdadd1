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
UPCAST_TILE_BYTES = 8 << 20  # fp32 bytes of K (and again of V) converted per tile when up-casting


class Workspace:
    """Reusable scratch buffers (large allocations are page-faulted afresh on every call otherwise).

    Not thread-safe: one per engine / benchmark loop. ``take`` returns a view of a named buffer,
    growing it when a larger one is needed.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        # Per-step memo of values derived from a context (e.g. the private-chunk table), which are the
        # same for every layer of a step. The owner calls `new_step()` whenever contexts may change.
        self.memo: dict[tuple, object] = {}

    def new_step(self) -> None:
        self.memo.clear()

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
    ws: Workspace | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of fp32 queries over keys ``k``/``v`` (any float dtype), returning fp32 ``(o, lse)``.

    q: [B, H, M, D] fp32; k, v: [B, H, T, D] (may be strided views); bias: additive fp32 mask
    broadcastable to [B, H, M, T] (``-inf`` drops a key) or None; causal: query m sees keys <= m
    (M == T, no bias). -> o: [B, H, M, D], lse: [B, H, M].
    """
    if causal and (k.dtype != torch.float32 or _FLASH_CPU is None or q.device.type != "cpu"):
        m, t = q.shape[-2], k.shape[-2]
        bias = torch.zeros(m, t, dtype=torch.float32, device=q.device).masked_fill_(
            torch.ones(m, t, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        causal = False
    if k.dtype != torch.float32:
        return _partial_upcast(q, k, v, scale, bias, ws or Workspace())
    if _FLASH_CPU is not None and q.device.type == "cpu":
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None, ws: Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-cast K/V to fp32 in (head, token) tiles that stay in cache. Head tiles are independent;
    token tiles (only when one head's keys exceed the budget) are merged by online softmax."""
    b, h, t, d = k.shape
    m = q.shape[2]
    per_head = b * t * d * 4
    hh = max(1, min(h, UPCAST_TILE_BYTES // max(1, per_head)))
    tile = t if hh > 1 or per_head <= UPCAST_TILE_BYTES else max(16, UPCAST_TILE_BYTES // max(1, b * d * 4))
    o_out = torch.empty(b, h, m, d, dtype=torch.float32, device=q.device)
    lse_out = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
    for h0 in range(0, h, hh):
        h1 = min(h, h0 + hh)
        bias_h = bias if bias is None or bias.dim() < 3 or bias.shape[-3] == 1 else bias[..., h0:h1, :, :]
        for t0 in range(0, t, tile):
            t1 = min(t, t0 + tile)
            kf = ws.take("up_k", (b, h1 - h0, t1 - t0, d), torch.float32, k.device)
            vf = ws.take("up_v", (b, h1 - h0, t1 - t0, d), torch.float32, k.device)
            kf.copy_(k[:, h0:h1, t0:t1])
            vf.copy_(v[:, h0:h1, t0:t1])
            o, lse = partial_attention(q[:, h0:h1], kf, vf, scale, None if bias_h is None else bias_h[..., t0:t1])
            if t0 == 0:
                o_out[:, h0:h1].copy_(o)
                lse_out[:, h0:h1].copy_(lse)
            else:
                o_acc, lse_acc = o_out[:, h0:h1], lse_out[:, h0:h1]
                merge_into(o_acc, lse_acc, o, lse)
    return o_out, lse_out


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


def group_size(counts: list[int], b: int, hkv: int, c: int, d: int, elem: int, group_bytes: int = 32 << 20) -> int:
    """Chunk positions gathered per step so that the K+V gather buffer stays near ``group_bytes``."""
    p_max = max(counts, default=0)
    return max(1, min(max(p_max, 1), group_bytes // max(1, 2 * b * hkv * c * d * elem)))


def num_groups(counts: list[int], group: int) -> int:
    return -(-max(counts, default=0) // group)


def dense_chunk_pass(
    q4: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    table: torch.Tensor,
    tokens: torch.Tensor,
    counts: list[int],
    group: int,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    ws: Workspace,
) -> None:
    """Attend each row over its chunk list, one partial per position group; loops over chunk positions.

    q4: [b, Hkv, g, D] fp32; k/v_pool_l: [Hkv, N, c, D]; table, tokens: [b, P] chunk ids / valid
    tokens (padding has 0 tokens); counts: host list, chunks per row. Positions are processed
    ``group`` at a time: the chunks of all rows still active there are gathered into one reusable
    buffer and attended in one batched call, whose partial goes to ``part_o[k]: [b, Hkv, g, D]``,
    ``part_lse[k]: [b, Hkv, g]`` (rows not active keep ``-inf``). Invalid slots of partly filled
    chunks are zeroed in the buffer and masked, so NaN in free pool slots cannot leak.
    """
    b, hkv, g, d = q4.shape
    c = k_pool_l.shape[2]
    counts_t = torch.tensor(counts, dtype=torch.int64)
    ar = torch.arange(c, device=tokens.device)
    for k, p0 in enumerate(range(0, max(counts, default=0), group)):
        p1 = min(max(counts), p0 + group)
        gsz = p1 - p0
        active = torch.nonzero(counts_t > p0).flatten()
        n_act = int(active.numel())
        rows = None if n_act == b else active.to(table.device)
        ids = table[:, p0:p1] if rows is None else table.index_select(0, rows)[:, p0:p1]
        tok = (tokens[:, p0:p1] if rows is None else tokens.index_select(0, rows)[:, p0:p1]).reshape(-1)
        q_a = q4 if rows is None else q4.index_select(0, rows)
        flat_ids = ids.reshape(-1).to(torch.int64)
        buf_shape = (hkv, n_act * gsz, c, d)
        kb = torch.index_select(k_pool_l, 1, flat_ids, out=ws.take("gather_k", buf_shape, k_pool_l.dtype, q4.device))
        vb = torch.index_select(v_pool_l, 1, flat_ids, out=ws.take("gather_v", buf_shape, v_pool_l.dtype, q4.device))
        part = torch.nonzero(tok < c).flatten()
        bias = None
        if part.numel():  # zero the invalid slots of the few partly filled (or padding) chunks
            bad = ar[None, :] >= tok.index_select(0, part)[:, None]  # [n_part, c]
            for buf in (kb, vb):
                sub = buf.index_select(1, part).masked_fill_(bad[None, :, :, None], 0.0)
                buf.index_copy_(1, part, sub)
            bias = torch.zeros(n_act * gsz, c, dtype=torch.float32, device=q4.device)
            bias.index_copy_(0, part, torch.zeros(bad.shape, device=q4.device).masked_fill_(bad, float("-inf")))
            bias = bias.view(n_act, 1, 1, gsz * c)
        kv_shape = (hkv, n_act, gsz * c, d)
        o, lse = partial_attention(
            q_a, kb.view(kv_shape).permute(1, 0, 2, 3), vb.view(kv_shape).permute(1, 0, 2, 3), scale, bias, ws
        )
        if rows is None:
            part_o[k].copy_(o)
            part_lse[k].copy_(lse)
        else:
            part_o[k].index_copy_(0, rows, o)
            part_lse[k].index_copy_(0, rows, lse)


def combine_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge S partials per row with one log-sum-exp (deterministic, fixed order), into ``out``.

    part_o: [S, b, H, D] fp32 (normalised); part_lse: [S, b, H] (``-inf`` = absent) -> out: [b, H, D].
    """
    m = part_lse.amax(dim=0)  # [b, H]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(part_lse - m)  # [S, b, H]
    w = w / w.sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    out.copy_((part_o * w.unsqueeze(-1)).sum(dim=0))
    return out
