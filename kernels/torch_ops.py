"""Building blocks shared by the PyTorch attention backends: partial attention and online-softmax merging.

A *partial* is ``(o, lse)``: the softmax-normalised output over a subset of keys and the log-sum-exp of
its scaled logits, both fp32. This is the paper's ``(o, m, n)`` triple with ``o/n`` stored and
``m + log n`` folded into one number; merging two partials is the paper's ``attn_reduce``.

On CPUs the partial comes from ATen's flash-attention kernel (it returns the log-sum-exp, is
blocked for the caches and runs on all threads); elsewhere from batched matmuls. Non-fp32 K/V are
up-cast to fp32 tile by tile, so a bf16/fp16 result is rounded once, at the very end.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def remember(self, key: tuple, value: object) -> None:
        """Store a memo entry; a caller that never calls `new_step` keeps at most 64 of them."""
        if len(self.memo) >= 64:
            self.memo.clear()
        self.memo[key] = value

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
        nq, nk = q.shape[-2], k.shape[-2]
        bias = torch.zeros(nq, nk, dtype=torch.float32, device=q.device).masked_fill_(
            torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        causal = False
    if k.dtype != torch.float32:
        return _partial_upcast(q, k, v, scale, bias, ws or Workspace())
    if _FLASH_CPU is not None and q.device.type == "cpu":
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return _drop_empty_rows(o, lse, bias)
    return _drop_empty_rows(*_partial_matmul(q, k, v, scale, bias), bias)


def _drop_empty_rows(o: torch.Tensor, lse: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A query row whose keys are all masked is an empty partial: o = 0, lse = -inf (ATen's flash kernel
    returns lse = 0 for it, the matmul path o = NaN; either would corrupt a log-sum-exp merge). In place:
    both come fresh from the kernel."""
    if bias is None:
        return o, lse
    empty = torch.isneginf(bias).all(dim=-1)  # broadcastable to lse: [B, H, M]
    return o.masked_fill_(empty.unsqueeze(-1), 0.0), lse.masked_fill_(empty, float("-inf"))


def _partial_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass(frozen=True)
class _GroupPlan:
    """What `dense_chunk_pass` needs for one position group; the same for every layer of a step."""

    p0: int
    width: int  # W: key slots read per row (valid-token columns of the group's chunk positions)
    rows: torch.Tensor | None  # [n_act] int64 active rows, None when every row is active
    flat: torch.Tensor  # [n_act * W] int64 token slots of the pool viewed as [Hkv, N*c, D]
    holes: torch.Tensor | None  # [n_holes] int64 gathered slots to zero (a row with no valid slot)
    bias: torch.Tensor | None  # [n_act, 1, 1, W] fp32: 0 valid, -inf invalid


def _group_plans(table: torch.Tensor, tokens: torch.Tensor, counts: list[int], group: int, c: int,
                 ws: Workspace) -> list[_GroupPlan]:
    """Per-group gather indices and masks, memoised in ``ws.memo`` (keyed by the table tensors, whose
    contents must not change before ``ws.new_step()``)."""
    key = ("dense_groups", id(table), id(tokens), group)
    hit = ws.memo.get(key)
    if hit is not None and hit[0] is table and hit[1] is tokens:  # type: ignore[index]
        return hit[2]  # type: ignore[index,return-value]
    b = table.shape[0]
    counts_t = torch.tensor(counts, dtype=torch.int64)
    p_max = max(counts, default=0)
    plans = []
    for p0 in range(0, p_max, group):
        p1 = min(p_max, p0 + group)
        active = torch.nonzero(counts_t > p0).flatten()
        rows = None if int(active.numel()) == b else active.to(table.device)
        ids = table[:, p0:p1] if rows is None else table.index_select(0, rows)[:, p0:p1]
        tok = (tokens[:, p0:p1] if rows is None else tokens.index_select(0, rows)[:, p0:p1]).reshape(-1)
        gsz = p1 - p0
        ids = ids.to(torch.int64)  # [n_act, gsz]
        tok = tok.view(-1, gsz)  # [n_act, gsz]
        # only the first max-valid-tokens slots of each chunk position are read (a decode batch's
        # private chunks are mostly partly filled): columns (position, offset), the same for every row
        widths = tok.amax(dim=0).clamp_min(1)  # [gsz]
        col_p = torch.repeat_interleave(torch.arange(gsz, device=ids.device), widths)  # [W]
        starts = torch.cumsum(widths, 0) - widths  # [gsz]
        col_o = torch.arange(col_p.shape[0], device=ids.device) - starts.index_select(0, col_p)  # [W]
        bad = col_o[None, :] >= tok[:, col_p]  # [n_act, W]: slots past a chunk's valid tokens
        # an invalid slot reads the row's first slot of the group instead (valid: the row is active
        # there), so the gathered buffer is finite without a zeroing pass; the bias masks it out
        first_ok = tok[:, :1] > 0  # [n_act, 1]
        flat = torch.where(bad & first_ok, ids[:, :1] * c, ids[:, col_p] * c + col_o[None, :]).reshape(-1)
        holes = torch.nonzero((bad & ~first_ok).reshape(-1)).flatten()  # rows with no valid slot: zeroed
        bias = None
        if bool(bad.any()):
            bias = torch.zeros(bad.shape, dtype=torch.float32, device=tokens.device).masked_fill_(bad, float("-inf"))
            bias = bias.view(ids.shape[0], 1, 1, -1)
        plans.append(_GroupPlan(p0, len(col_o), rows, flat, holes if holes.numel() else None, bias))
    ws.remember(key, (table, tokens, plans))
    return plans


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
    ``part_lse[k]: [b, Hkv, g]`` (rows not active keep ``-inf``). The gather is token-granular: an
    invalid slot of a partly filled chunk reads a valid slot of the same row in its place and is
    masked, so NaN in free pool slots cannot leak and no zeroing pass is needed. Indices and masks
    are built once per step (see `_group_plans`).
    """
    _b, hkv, _g, d = q4.shape
    c = k_pool_l.shape[2]
    for k, gp in enumerate(_group_plans(table, tokens, counts, group, c, ws)):
        n_act = gp.flat.shape[0] // gp.width
        q_a = q4 if gp.rows is None else q4.index_select(0, gp.rows)
        buf_shape = (hkv, gp.flat.shape[0], d)
        kb = torch.index_select(k_pool_l.reshape(hkv, -1, d), 1, gp.flat,
                                out=ws.take("gather_k", buf_shape, k_pool_l.dtype, q4.device))
        vb = torch.index_select(v_pool_l.reshape(hkv, -1, d), 1, gp.flat,
                                out=ws.take("gather_v", buf_shape, v_pool_l.dtype, q4.device))
        if gp.holes is not None:
            kb.index_fill_(1, gp.holes, 0.0)
            vb.index_fill_(1, gp.holes, 0.0)
        kv_shape = (hkv, n_act, gp.width, d)
        o, lse = partial_attention(
            q_a, kb.view(kv_shape).permute(1, 0, 2, 3), vb.view(kv_shape).permute(1, 0, 2, 3), scale, gp.bias, ws
        )
        if gp.rows is None:
            part_o[k].copy_(o)
            part_lse[k].copy_(lse)
        else:
            part_o[k].index_copy_(0, gp.rows, o)
            part_lse[k].index_copy_(0, gp.rows, lse)


def combine_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge S partials per row with one log-sum-exp (deterministic, fixed order), into ``out``.

    part_o: [S, b, H, D] fp32 (normalised); part_lse: [S, b, H] (``-inf`` = absent) -> out: [b, H, D].
    """
    m = part_lse.amax(dim=0).clamp_min_(torch.finfo(torch.float32).min)  # [b, H]; finite if all absent
    w = torch.exp(part_lse - m)  # [S, b, H]
    w = w / w.sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    out.copy_((part_o * w.unsqueeze(-1)).sum(dim=0))
    return out


def finish(res: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """res: [b, Hq, D] fp32 -> ``out`` (or a new tensor) in ``like``'s dtype."""
    if out is None:
        return res.to(like.dtype, copy=True)
    return out.copy_(res)
