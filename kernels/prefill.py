"""Prefill attention over a cached prefix: new tokens attend causally to cached + new tokens.

Row ``b``'s ``n_b`` new tokens are ``q[cu_q[b]:cu_q[b+1]]`` at positions ``q_start[b] ..
q_start[b]+n_b-1``; their K/V are already in the row's chunks (``block_table[b]``, with
``block_tokens[b]`` valid tokens each, partly filled chunks allowed anywhere). So the engine runs
the model only on uncached tokens and still gets exact attention over the whole sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.kernels.prefill_runs import CpuPrefillPlan, causal_runs, chunk_first_prefill, run_kernel
from chunkserve.kernels.torch_ops import merge_into, partial_attention

PREFILL_BACKENDS = ("torch", "triton", "auto")


def _as_list(x: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


@dataclass(frozen=True)
class PrefillTables:
    """A step's prefill tables, built and checked on the host once and read by every layer.

    ``table_host``/``tokens_host``: [B, P] chunk ids / valid tokens (host, for the torch path and the
    checks); ``starts``: [B] first new position per row, ``cu``: [B+1] offsets of the rows' new tokens
    in q (host lists). Device tensors, int32: ``block_table``, ``block_tokens``, ``block_pos`` [B, P]
    (first key position of each chunk), ``q_start`` [B], ``cu_q`` [B+1]. Nothing is read back from them.
    """

    table_host: np.ndarray
    tokens_host: np.ndarray
    starts: list[int]
    cu: list[int]
    block_table: torch.Tensor
    block_tokens: torch.Tensor
    block_pos: torch.Tensor
    q_start: torch.Tensor
    cu_q: torch.Tensor

    @functools.cached_property
    def lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """(chunk ids, valid tokens) per row as host lists, made once for all layers (torch path)."""
        return self.table_host.tolist(), self.tokens_host.tolist()

    def cpu_plan(self, c: int, causal: bool = False) -> CpuPrefillPlan:
        """The CPU path's runs and small-row tables for chunk size ``c`` (``causal``: the AMX form,
        `CpuPrefillPlan.build`), made once for all layers."""
        key = f"_cpu_plan_{c}_{int(causal)}"
        plan = self.__dict__.get(key)
        if plan is None:
            plan = CpuPrefillPlan.build(*self.lists, self.starts, self.cu, c, causal)
            self.__dict__[key] = plan  # a per-step memo on a frozen instance, as functools.cached_property does
        return plan

    @classmethod
    def from_host(cls, table: np.ndarray, tokens: np.ndarray, starts: list[int], cu: list[int],
                  device: torch.device | str = "cpu") -> PrefillTables:
        """Checked tables of one step from host arrays, their device copies made here (one copy each; the
        engine packs them into its step's single transfer instead)."""
        arrays = cls.host_arrays(table, tokens, starts, cu)
        return cls(table, tokens, starts, cu, **{k: torch.from_numpy(a).to(device) for k, a in arrays.items()})

    @staticmethod
    def host_arrays(table: np.ndarray, tokens: np.ndarray, starts: list[int], cu: list[int]
                    ) -> dict[str, np.ndarray]:
        """Check the host tables (ValueError if malformed) and derive the arrays the device needs."""
        check_prefill_tables(table.shape, tokens, starts, cu, cu[-1] if cu else 0)
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        return dict(block_table=np.ascontiguousarray(table, dtype=np.int32), block_tokens=tok,
                    block_pos=(np.cumsum(tok, axis=1, dtype=np.int32) - tok),
                    q_start=np.asarray(starts, dtype=np.int32), cu_q=np.asarray(cu, dtype=np.int32))


def check_prefill_tables(table_shape: tuple[int, ...], tokens: np.ndarray, starts: list[int], cu: list[int],
                         num_q: int) -> None:
    """Raise ValueError for malformed prefill tables (host data only: nothing is read from a device)."""
    b = len(starts)
    if len(table_shape) != 2 or table_shape[0] != b or tuple(tokens.shape) != tuple(table_shape):
        raise ValueError("block_table and block_tokens must both be [B, max_chunks] with B = len(q_start)")
    if len(cu) != b + 1 or cu[0] != 0 or cu[-1] != num_q or any(cu[i] > cu[i + 1] for i in range(b)):
        raise ValueError(f"cu_q must be {b + 1} non-decreasing offsets from 0 to {num_q}")
    totals = tokens.sum(axis=1).tolist() if b else []
    for i in range(b):
        if starts[i] < 0 or starts[i] + cu[i + 1] - cu[i] > totals[i]:
            raise ValueError(f"row {i}: new tokens end at {starts[i] + cu[i + 1] - cu[i]} "
                             f"but its chunks hold {totals[i]} tokens")


def check_prefill_q(q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor) -> None:
    """Raise ValueError for a malformed q or pool layer (shapes and dtypes only)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor [T, Hq, D]")
    if k_pool_l.dim() != 4 or k_pool_l.shape != v_pool_l.shape:
        raise ValueError("k/v pool layers must both be [Hkv, N, c, D]")
    hkv, _n, _c, d = k_pool_l.shape
    if q.shape[2] != d or q.shape[1] % hkv != 0:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit pools with Hkv={hkv}, D={d}")
    if q.dtype != k_pool_l.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} must equal the pool dtype {k_pool_l.dtype} (fp32/fp16/bf16)")


def _segments(ids: list[int], toks: list[int], c: int, length: int) -> list[tuple[int, int, int, list[int]]]:
    """Split a row's first ``length`` keys into pieces that are views of the pool where possible.

    Returns (key offset, number of keys, first chunk id, chunk ids) per piece: consecutive chunk
    ids whose chunks (but the last) are full form one piece; any other chunk starts a new piece, so
    every piece is a view of the pool and nothing is ever gathered.
    """
    out: list[tuple[int, int, int, list[int]]] = []
    pos = 0
    for cid, nt in zip(ids, toks, strict=True):
        if pos >= length:
            break
        nt = min(nt, length - pos)
        if nt <= 0:
            continue
        if out and out[-1][2] + len(out[-1][3]) == cid and out[-1][1] == c * len(out[-1][3]):
            k0, n, first, lst = out[-1]
            out[-1] = (k0, n + nt, first, [*lst, cid])
        else:
            out.append((pos, nt, cid, [cid]))
        pos += nt
    return out


def prefill_torch(
    q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, tables: list[list[int]],
    tokens: list[list[int]], starts: list[int], cu: list[int], scale: float,
) -> torch.Tensor:
    """Loop over rows; each row reads its keys in place (one view per run of consecutive chunks).

    The g query heads of a KV head are packed into the query rows (``[1, Hkv, g*n_b, D]``), so
    each key is read once per KV head; pieces are merged by online softmax. A row with nothing
    cached and one piece is one plain causal call. Where the CPU kernels are built, `prefill_step` goes
    chunk-first instead (`prefill_runs.py`); this loop serves the other cases and is its reference.
    """
    hkv, _n, c, d = k_pool_l.shape
    hq = q.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    for b in range(len(starts)):
        n_b = cu[b + 1] - cu[b]
        if n_b == 0:
            continue
        length = starts[b] + n_b
        pieces = _segments(tables[b], tokens[b], c, length)
        qrow = q[cu[b] : cu[b + 1]].float()  # [n_b, Hq, D]
        if starts[b] == 0 and len(pieces) == 1:  # nothing cached: plain causal attention
            o, _lse = _causal_square(qrow, _piece(k_pool_l, pieces[0]), _piece(v_pool_l, pieces[0]), g, scale)
            out[cu[b] : cu[b + 1]] = o.permute(2, 1, 0, 3).reshape(n_b, hq, d).to(q.dtype)
            continue
        qb = qrow.view(n_b, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n_b, d)  # row gi*n_b + i
        acc: tuple[torch.Tensor, torch.Tensor] | None = None
        for o, lse in _row_parts(qb, qrow, k_pool_l, v_pool_l, pieces, starts[b], n_b, g, scale):
            if acc is None:
                acc = (o.clone(), lse.clone())
            else:
                merge_into(acc[0], acc[1], o, lse)
        assert acc is not None  # length = starts[b] + n_b > 0 keys: at least one part
        res = acc[0].view(hkv, g, n_b, d).permute(2, 0, 1, 3).reshape(n_b, hq, d)
        out[cu[b] : cu[b + 1]] = res.to(q.dtype)
    return out


def _causal_square(qrow: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's n new tokens over their own n keys, causal. qrow: [n, Hq, D] fp32; k, v: [Hkv, n, D] ->
    o [g, Hkv, n, D], lse [g, Hkv, n]: queries laid out so that row index = position, so the kernel skips the
    masked half (each GQA group shares its KV head through an expand, not a copy)."""
    n, hq, d = qrow.shape
    hkv = k.shape[0]
    qg = qrow.view(n, hkv, g, d).permute(2, 1, 0, 3)  # [g, Hkv, n, D]
    return partial_attention(qg, k.unsqueeze(0).expand(g, -1, -1, -1), v.unsqueeze(0).expand(g, -1, -1, -1),
                             scale, causal=True)


def _row_parts(qb: torch.Tensor, qrow: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
               pieces: list[tuple[int, int, int, list[int]]], start: int, n_b: int, g: int, scale: float
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Partial (o, lse) of one row over its key pieces, each [1, Hkv, g*n_b, D] / [1, Hkv, g*n_b].

    Keys before ``start`` (the cached prefix) are seen by every new token: no mask. When the new tokens'
    keys are one view, they are one `_causal_square` call; otherwise each piece holding new keys gets a mask.
    """
    hkv, _n, _c, d = k_pool_l.shape
    q_pos = None
    for piece in pieces:
        k0, n = piece[0], piece[1]
        k, v = _piece(k_pool_l, piece).unsqueeze(0), _piece(v_pool_l, piece).unsqueeze(0)  # [1, Hkv, n, D]
        cut = min(max(start - k0, 0), n)  # keys [0, cut) of the piece are cached ones
        if cut:
            yield partial_attention(qb, k[:, :, :cut], v[:, :, :cut], scale)
        if cut == n:
            continue
        if k0 + cut == start and n - cut == n_b:  # exactly the new tokens: square causal
            o, lse = _causal_square(qrow, k[0, :, cut:], v[0, :, cut:], g, scale)
            yield (o.permute(1, 0, 2, 3).reshape(1, hkv, g * n_b, d),
                   lse.permute(1, 0, 2).reshape(1, hkv, g * n_b))
            continue
        if q_pos is None:
            q_pos = (torch.arange(n_b, device=qb.device) + start).repeat(g)  # [g*n_b]
        k_pos = torch.arange(k0 + cut, k0 + n, device=qb.device)
        bias = torch.zeros(1, 1, g * n_b, n - cut, dtype=torch.float32, device=qb.device)
        bias.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        yield partial_attention(qb, k[:, :, cut:], v[:, :, cut:], scale, bias)


def _piece(pool: torch.Tensor, piece: tuple[int, int, int, list[int]]) -> torch.Tensor:
    """The keys (or values) of one piece, [Hkv, n, D]: a view of the pool."""
    _k0, n, first, ids = piece
    hkv, _n, c, d = pool.shape
    return pool[:, first : first + len(ids)].reshape(hkv, len(ids) * c, d)[:, :n]


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
    Convenience form: tables on a GPU are read back here to check them; the engine builds
    `PrefillTables` on the host once per step and calls `prefill_step`, which reads nothing back.
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"unknown prefill backend {backend!r}; expected one of {PREFILL_BACKENDS}")
    check_prefill_q(q, k_pool_l, v_pool_l)
    if block_table.dim() != 2 or block_tokens.shape != block_table.shape:
        raise ValueError("block_table and block_tokens must both be [B, max_chunks] with B = len(q_start)")
    starts, cu = _as_list(q_start), _as_list(cu_q)
    table_h = block_table.cpu().numpy()
    tokens_h = block_tokens.cpu().numpy()
    if len(cu) != len(starts) + 1 or (cu and cu[-1] != q.shape[0]):
        raise ValueError(f"cu_q must be {len(starts) + 1} non-decreasing offsets from 0 to {q.shape[0]}")
    tables = PrefillTables.from_host(table_h, tokens_h, starts, cu, k_pool_l.device)
    return prefill_step(q, k_pool_l, v_pool_l, tables, scale, backend)


def prefill_step(q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, tables: PrefillTables,
                 scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """`prefill_attention` over tables checked on the host (`PrefillTables`): no device read-back."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"unknown prefill backend {backend!r}; expected one of {PREFILL_BACKENDS}")
    check_prefill_q(q, k_pool_l, v_pool_l)
    if q.shape[0] != (tables.cu[-1] if tables.cu else 0):
        raise ValueError(f"q has {q.shape[0]} rows but the tables describe {tables.cu[-1] if tables.cu else 0}")
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" else "torch"
    if backend == "triton":
        from chunkserve.kernels.prefill_triton import prefill_triton

        return prefill_triton(q, k_pool_l, v_pool_l, tables, float(scale))
    kern = run_kernel(q, k_pool_l)
    if kern is not None:  # chunk-first over the step's plan, built once for all layers
        plan = tables.cpu_plan(k_pool_l.shape[2], causal_runs(kern, k_pool_l))
        return chunk_first_prefill(kern, q, k_pool_l, v_pool_l, plan, float(scale)).to(q.dtype)
    return prefill_torch(q, k_pool_l, v_pool_l, *tables.lists, tables.starts, tables.cu, float(scale))
