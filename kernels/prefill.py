"""Prefill attention over a cached prefix: new tokens attend causally to cached + new tokens.

Row ``b``'s ``n_b`` new tokens are ``q[cu_q[b]:cu_q[b+1]]`` at positions ``q_start[b] ..
q_start[b]+n_b-1``; their K/V are already in the row's chunks (``block_table[b]``, with
``block_tokens[b]`` valid tokens each, partly filled chunks allowed anywhere). So the engine runs
the model only on uncached tokens and still gets exact attention over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chunkserve.kernels.torch_ops import partial_attention

PREFILL_BACKENDS = ("torch", "triton", "auto")


def _as_list(x: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def check_prefill_inputs(
    q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, block_table: torch.Tensor,
    block_tokens: torch.Tensor, starts: list[int], cu: list[int],
) -> None:
    """Raise ValueError for malformed prefill inputs."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor [T, Hq, D]")
    if k_pool_l.dim() != 4 or k_pool_l.shape != v_pool_l.shape:
        raise ValueError("k/v pool layers must both be [Hkv, N, c, D]")
    hkv, _n, _c, d = k_pool_l.shape
    if q.shape[2] != d or q.shape[1] % hkv != 0:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit pools with Hkv={hkv}, D={d}")
    if q.dtype != k_pool_l.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} must equal the pool dtype {k_pool_l.dtype} (fp32/fp16/bf16)")
    b = len(starts)
    if block_table.dim() != 2 or block_table.shape[0] != b or block_tokens.shape != block_table.shape:
        raise ValueError("block_table and block_tokens must both be [B, max_chunks] with B = len(q_start)")
    if len(cu) != b + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or any(cu[i] > cu[i + 1] for i in range(b)):
        raise ValueError(f"cu_q must be {b + 1} non-decreasing offsets from 0 to {q.shape[0]}")
    totals = _as_list(block_tokens.sum(dim=1))
    for i in range(b):
        if starts[i] < 0 or starts[i] + cu[i + 1] - cu[i] > totals[i]:
            raise ValueError(f"row {i}: new tokens end at {starts[i] + cu[i + 1] - cu[i]} "
                             f"but its chunks hold {totals[i]} tokens")


def prefill_torch(
    q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, block_table: torch.Tensor,
    block_tokens: torch.Tensor, starts: list[int], cu: list[int], scale: float,
) -> torch.Tensor:
    """Loop over rows; each row: gather its valid keys once, one offset-causal attention call."""
    hkv, _n, c, d = k_pool_l.shape
    hq = q.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    ar = torch.arange(c, device=q.device)
    k_flat = k_pool_l.reshape(hkv, -1, d)
    v_flat = v_pool_l.reshape(hkv, -1, d)
    for b in range(len(starts)):
        n_b = cu[b + 1] - cu[b]
        if n_b == 0:
            continue
        ids = block_table[b].to(torch.int64)
        toks = block_tokens[b]
        valid = ar[None, :] < toks[:, None]  # [P, c]
        flat = (ids[:, None] * c + ar[None, :])[valid][: starts[b] + n_b]  # [L]
        length = int(flat.numel())
        k = k_flat.index_select(1, flat).unsqueeze(0).expand(g, hkv, length, d)
        v = v_flat.index_select(1, flat).unsqueeze(0).expand(g, hkv, length, d)
        qb = q[cu[b] : cu[b + 1]].float().view(n_b, hkv, g, d).permute(2, 1, 0, 3)  # [g, Hkv, n_b, D]
        if starts[b] == 0:  # nothing cached: plain causal attention
            o, _lse = partial_attention(qb, k, v, scale, causal=True)
        else:
            q_pos = torch.arange(n_b, device=q.device) + starts[b]
            k_pos = torch.arange(length, device=q.device)
            bias = torch.zeros(1, 1, n_b, length, dtype=torch.float32, device=q.device)
            bias.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            o, _lse = partial_attention(qb, k, v, scale, bias)  # [g, Hkv, n_b, D]
        out[cu[b] : cu[b + 1]] = o.permute(2, 1, 0, 3).reshape(n_b, hq, d).to(q.dtype)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    block_table: torch.Tensor,
    block_tokens: torch.Tensor,
    q_start: torch.Tensor | Sequence[int],
    cu_q: torch.Tensor | Sequence[int],
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of new tokens over cached + new tokens. q: [T, Hq, D] -> o: [T, Hq, D].

    block_table, block_tokens: [B, P] int32; q_start: [B] first new position per row;
    cu_q: [B+1] offsets of each row's new tokens in q. backend: "torch" | "triton" | "auto".
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"unknown prefill backend {backend!r}; expected one of {PREFILL_BACKENDS}")
    starts, cu = _as_list(q_start), _as_list(cu_q)
    check_prefill_inputs(q, k_pool_l, v_pool_l, block_table, block_tokens, starts, cu)
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" else "torch"
    if backend == "triton":
        from chunkserve.kernels.prefill_triton import prefill_triton

        return prefill_triton(q, k_pool_l, v_pool_l, block_table, block_tokens, starts, cu, float(scale))
    return prefill_torch(q, k_pool_l, v_pool_l, block_table, block_tokens, starts, cu, float(scale))
