"""ModelRunner: turns a `StepPlan` into one model forward over the flattened tokens of the step.

Rows are laid out as [prefill pieces..., decode rows in tree order]. The per-layer attention
(`StepAttention`) first scatters the step's new K/V into their pool slots, then runs prefill
attention over each piece's cached prefix and TPP decode attention over the decode rows.
Everything that is the same for all layers (slot indices, prefill tables) is built once per step;
the decode kernels reuse one scratch `Workspace` across layers and steps.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.api import DecodeFn, check_decode_inputs, get_decode_fn, resolve_backend
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.prefill import prefill_attention
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.model import CausalLM
from chunkserve.workers.scheduler import Request, StepPlan


class StepAttention:
    """The `AttentionFn` of one step: K/V writes + prefill attention + decode attention."""

    def __init__(self, cache: PrefixKVCache, plan: StepPlan, decode_backend: str, prefill_backend: str,
                 scale: float, workspace: Workspace | None = None, pools: PoolViews | None = None) -> None:
        dev = cache.pool.device
        c = cache.chunk_size
        self.cache = cache
        self.pools = pools if pools is not None else PoolViews(cache)
        self.scale = scale
        self.decode_backend = decode_backend
        self._decode_fn: DecodeFn | None = None  # resolved on the first decode layer of the step
        self.prefill_backend = prefill_backend
        self.workspace = workspace
        if workspace is not None:
            workspace.new_step()  # contexts' token counts are refreshed in place between steps
        # flat slot of every new token in a layer's pool viewed as [Hkv, N*c, D]
        self.slots = torch.tensor([ch * c + off for ch, off in zip(plan.slot_chunks, plan.slot_offsets, strict=True)],
                                  dtype=torch.long, device=dev)  # [T_write]
        # rows that write K/V (all but the logits-only rows of fully cached prompts)
        self.write_rows: torch.Tensor | None = None
        if any(not p.write for p in plan.prefills):
            rows: list[int] = []
            r = 0
            for p in plan.prefills:
                if p.write:
                    rows += range(r, r + len(p.tokens))
                r += len(p.tokens)
            rows += range(r, r + len(plan.decodes))
            self.write_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.num_prefill = sum(len(p.tokens) for p in plan.prefills)
        self.ctx: ChunkContext | None = plan.decode_ctx  # type: ignore[assignment]
        if plan.prefills:
            tables = [cache.seq_chunks(p.req.seq_id) for p in plan.prefills]
            width = max(len(t) for t in tables)
            bt = [t + [0] * (width - len(t)) for t in tables]
            btok = []
            for t, p in zip(tables, plan.prefills, strict=True):
                n = len(t)
                btok.append([c] * (n - 1) + [cache.seq_len(p.req.seq_id) - c * (n - 1)] + [0] * (width - n))
            self.block_table = torch.tensor(bt, dtype=torch.int32, device=dev)  # [B, P]
            self.block_tokens = torch.tensor(btok, dtype=torch.int32, device=dev)  # [B, P]
            self.q_start = [p.start for p in plan.prefills]
            cu = [0]
            for p in plan.prefills:
                cu.append(cu[-1] + len(p.tokens))
            self.cu_q = cu

    def _prefill(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        return prefill_attention(q, kp, vp, self.block_table, self.block_tokens, self.q_start, self.cu_q,
                                 self.scale, self.prefill_backend)

    def _decode(self, layer: int, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                out: torch.Tensor | None) -> torch.Tensor:
        # q: [b, Hq, D] in tree order -> [b, Hq, D]; inputs are validated on the first layer only
        # (every layer of a step has the same shapes, dtypes and context)
        if self.ctx is None:
            raise RuntimeError("decode rows without a decode context")
        if layer == 0 or self._decode_fn is None:
            check_decode_inputs(q, kp, vp, self.ctx.batch_size)
            self._decode_fn = get_decode_fn(resolve_backend(self.decode_backend, q.device))
        return self._decode_fn(q, kp, vp, self.ctx, self.scale, out=out, workspace=self.workspace)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], k, v: [T, Hkv, D] -> o: [T, Hq, D]
        kp, vp = self.pools.k[layer], self.pools.v[layer]  # [Hkv, N, c, D] (contiguous)
        # the same scatter as `cache.write`, as one index_copy_ per pool on the flat slot index
        if self.write_rows is not None:
            k, v = k.index_select(0, self.write_rows), v.index_select(0, self.write_rows)
        if k.dtype != kp.dtype:
            k, v = k.to(kp.dtype), v.to(vp.dtype)
        self.pools.k_flat[layer].index_copy_(1, self.slots, k.transpose(0, 1))
        self.pools.v_flat[layer].index_copy_(1, self.slots, v.transpose(0, 1))
        if self.cache.pending_copies:
            self.cache.apply_copies(layer)
        tp = self.num_prefill
        if tp == q.shape[0]:
            return self._prefill(q, kp, vp)
        if tp == 0:
            return self._decode(layer, q, kp, vp, None)
        o = torch.empty_like(q)
        o[:tp] = self._prefill(q[:tp], kp, vp)
        self._decode(layer, q[tp:], kp, vp, o[tp:])
        return o


class PoolViews:
    """Per-layer views of the cache's K/V pools, made once instead of twice per layer per step."""

    def __init__(self, cache: PrefixKVCache) -> None:
        self.k_pool, self.v_pool = cache.k_pool, cache.v_pool  # [L, Hkv, N, c, D]
        _l, hkv, n, c, d = self.k_pool.shape
        self.k = list(self.k_pool.unbind(0))  # L x [Hkv, N, c, D]
        self.v = list(self.v_pool.unbind(0))
        self.k_flat = [t.view(hkv, n * c, d) for t in self.k]  # L x [Hkv, N*c, D]: flat slot index
        self.v_flat = [t.view(hkv, n * c, d) for t in self.v]

    def current(self, cache: PrefixKVCache) -> bool:
        """Whether these views still belong to the cache's pool tensors."""
        return cache.k_pool is self.k_pool and cache.v_pool is self.v_pool


class ModelRunner:
    """Runs the model for a step plan and returns the logits of the rows that sample."""

    def __init__(self, model: CausalLM, cache: PrefixKVCache, decode_backend: str = "auto",
                 prefill_backend: str = "auto") -> None:
        self.model = model
        self.cache = cache
        self.decode_backend = decode_backend
        self.prefill_backend = prefill_backend
        self.scale = model.config.head_dim ** -0.5
        self.workspace = Workspace()  # decode scratch buffers, reused by every layer of every step
        self.pools = PoolViews(cache)
        self.tokens_computed = 0  # total tokens run through the model (prefill + decode)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request]]:
        """Forward the step; returns (logits [n, V] fp32, the n requests that sample, in row order)."""
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for piece in plan.prefills:
            ids += piece.tokens
            pos += range(piece.start, piece.start + len(piece.tokens))
            if piece.samples:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(piece.req)
        base = len(ids)
        if plan.decodes:
            sample_rows += range(base, base + len(plan.decodes))
            sample_reqs += plan.decodes
            ids += [req.output[-1] for req in plan.decodes]
            pos += [len(req.prompt) + len(req.output) - 1 for req in plan.decodes]
        dev = self.cache.pool.device
        if not self.pools.current(self.cache):
            self.pools = PoolViews(self.cache)
        attn = StepAttention(self.cache, plan, self.decode_backend, self.prefill_backend, self.scale,
                             self.workspace, self.pools)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.tensor(pos, dtype=torch.long, device=dev), attn)  # [T, H]
        self.tokens_computed += len(ids)
        if not sample_rows:
            return hidden.new_zeros(0, 0, dtype=torch.float32), []
        if len(sample_rows) < len(ids):
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(hidden), sample_reqs
