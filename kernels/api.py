"""Public entry point: ``chunk_attention(q, cache, seq_ids, layer, backend, scale)``.

The cache supplies the pools (``cache.k_pool/v_pool: [L, Hkv, N, c, D]``) and the kernel context
(``cache.context(seq_ids)``, rows in tree order). ``decode_attention`` is the lower-level call the
engine uses with a context and per-layer pools it already holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.torch_ops import Workspace

BACKENDS = ("torch", "triton", "paged-torch", "paged-triton", "reference", "auto")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

DecodeFn = Callable[..., torch.Tensor]


class ChunkCache(Protocol):
    """What chunk_attention needs from a cache (``PrefixKVCache`` satisfies it)."""

    k_pool: torch.Tensor  # [L, Hkv, N, c, D]
    v_pool: torch.Tensor  # [L, Hkv, N, c, D]

    def context(self, seq_ids: Sequence[int]) -> ChunkContext: ...


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``auto`` to ``triton`` on CUDA and ``torch`` elsewhere; reject unknown names."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def get_decode_fn(backend: str) -> DecodeFn:
    """The decode function ``fn(q_sorted, k_pool_l, v_pool_l, ctx, scale, out=None, workspace=None)``.

    For the torch backends the in-place CPU kernel is built (or loaded from its cache) here, so that
    an engine pays for it at start-up, not on its first request.
    """
    if backend in ("torch", "paged-torch"):
        from chunkserve.kernels.cpu_kernel import load_cpu_kernel

        load_cpu_kernel()
    if backend == "torch":
        from chunkserve.kernels.tpp_torch import tpp_decode_torch

        return tpp_decode_torch
    if backend == "paged-torch":
        from chunkserve.kernels.paged_torch import paged_decode_torch

        return paged_decode_torch
    if backend == "reference":
        from chunkserve.kernels.reference import reference_decode

        return reference_decode
    if backend == "triton":
        from chunkserve.kernels.tpp_triton import tpp_decode_triton

        return tpp_decode_triton
    if backend == "paged-triton":
        from chunkserve.kernels.paged_triton import paged_decode_triton

        return paged_decode_triton
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def check_decode_inputs(q: Any, k_pool_l: Any, v_pool_l: Any, batch: int) -> None:
    """Raise ValueError/TypeError for malformed decode inputs (q: [b, Hq, D], pools [Hkv, N, c, D])."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    for name, pool in (("k_pool", k_pool_l), ("v_pool", v_pool_l)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
            raise ValueError(f"{name} layer must be a 4-d tensor [Hkv, N, c, D]")
    if k_pool_l.shape != v_pool_l.shape or k_pool_l.dtype != v_pool_l.dtype:
        raise ValueError(f"k/v pools differ: {tuple(k_pool_l.shape)} {k_pool_l.dtype} vs "
                         f"{tuple(v_pool_l.shape)} {v_pool_l.dtype}")
    hkv, _n, _c, d = k_pool_l.shape
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, Hq, D], got shape {tuple(q.shape)}")
    if q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows but {batch} sequences were given")
    if q.shape[2] != d:
        raise ValueError(f"q head dim {q.shape[2]} != cache head dim {d}")
    if q.shape[1] % hkv != 0 or q.shape[1] == 0:
        raise ValueError(f"Hq={q.shape[1]} must be a positive multiple of Hkv={hkv}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported; use one of {DTYPES}")
    if q.dtype != k_pool_l.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_pool_l.dtype}")
    if q.device != k_pool_l.device:
        raise ValueError(f"q is on {q.device} but the cache is on {k_pool_l.device}")


def decode_attention(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Decode attention on tree-ordered queries. q_sorted: [b, Hq, D] -> [b, Hq, D] (tree order).

    ``out`` receives the result if given; ``workspace`` (reused across calls) holds scratch buffers.
    """
    name = resolve_backend(backend, k_pool_l.device)
    check_decode_inputs(q_sorted, k_pool_l, v_pool_l, ctx.batch_size)
    if scale is None:
        scale = float(q_sorted.shape[-1]) ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")  # the backends disagreed on NaN
    return get_decode_fn(name)(q_sorted, k_pool_l, v_pool_l, ctx, float(scale), out=out, workspace=workspace)


def chunk_attention(
    q: torch.Tensor,
    cache: ChunkCache,
    seq_ids: Sequence[int],
    layer: int = 0,
    backend: str = "torch",
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over its cached chunks.

    q: [len(seq_ids), Hq, D] in the caller's order -> o: same shape, dtype and order.
    backend: "torch" | "triton" (TPP), "paged-torch" | "paged-triton" (baselines), "reference", "auto".
    scale defaults to D**-0.5.
    """
    k_pool, v_pool = cache.k_pool, cache.v_pool
    if not isinstance(k_pool, torch.Tensor) or k_pool.dim() != 5:
        raise ValueError("cache.k_pool must be a tensor [L, Hkv, N, c, D]")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < k_pool.shape[0]:
        raise ValueError(f"layer must be an int in [0, {k_pool.shape[0]}), got {layer!r}")
    name = resolve_backend(backend, k_pool.device)
    seq_ids = list(seq_ids)
    if any(isinstance(s, bool) or not hasattr(type(s), "__index__") for s in seq_ids):
        raise TypeError(f"seq_ids must be integers, got {seq_ids!r}")  # 0.9 was read as sequence 0
    check_decode_inputs(q, k_pool[layer], v_pool[layer], len(seq_ids))
    if len(seq_ids) == 0:
        return q.new_empty(q.shape)
    ctx = cache.context(seq_ids)
    order = ctx.order.to(device=q.device, dtype=torch.int64)
    q_sorted = q.index_select(0, order)
    o_sorted = decode_attention(q_sorted, k_pool[layer], v_pool[layer], ctx, scale, name)
    o = torch.empty_like(o_sorted)
    o.index_copy_(0, order, o_sorted)
    return o
