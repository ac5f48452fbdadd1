"""ModelRunner: turns a `StepPlan` into one model forward over the flattened tokens of the step.

Rows are laid out as [prefill pieces..., decode rows in tree order]. The per-layer attention
(`StepAttention`) first scatters the step's new K/V into their pool slots, then runs prefill
attention over each piece's cached prefix and TPP decode attention over the decode rows.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.api import decode_attention
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.prefill import prefill_attention
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.model import CausalLM
from chunkserve.workers.scheduler import Request, StepPlan


class StepAttention:
    """The `AttentionFn` of one step: K/V writes + prefill attention + decode attention."""

    def __init__(self, cache: PrefixKVCache, plan: StepPlan, decode_backend: str, prefill_backend: str,
                 scale: float) -> None:
        dev = cache.pool.device
        self.cache = cache
        self.scale = scale
        self.decode_backend = decode_backend
        self.prefill_backend = prefill_backend
        self.chunks = torch.tensor(plan.slot_chunks, dtype=torch.long, device=dev)  # [T]
        self.offsets = torch.tensor(plan.slot_offsets, dtype=torch.long, device=dev)  # [T]
        self.num_prefill = sum(len(p.tokens) for p in plan.prefills)
        self.ctx: ChunkContext | None = plan.decode_ctx  # type: ignore[assignment]
        if plan.prefills:
            c = cache.chunk_size
            tables = [cache.seq_chunks(p.req.seq_id) for p in plan.prefills]
            width = max(len(t) for t in tables)
            bt = torch.zeros(len(tables), width, dtype=torch.int32)
            btok = torch.zeros(len(tables), width, dtype=torch.int32)
            for i, (t, p) in enumerate(zip(tables, plan.prefills, strict=True)):
                n = len(t)
                bt[i, :n] = torch.tensor(t, dtype=torch.int32)
                btok[i, :n] = c
                btok[i, n - 1] = cache.seq_len(p.req.seq_id) - c * (n - 1)
            self.block_table, self.block_tokens = bt.to(dev), btok.to(dev)
            self.q_start = [p.start for p in plan.prefills]
            cu = [0]
            for p in plan.prefills:
                cu.append(cu[-1] + len(p.tokens))
            self.cu_q = cu

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], k, v: [T, Hkv, D] -> o: [T, Hq, D]
        self.cache.write(layer, self.chunks, self.offsets, k, v)
        if self.cache.pending_copies:
            self.cache.apply_copies(layer)
        kp, vp = self.cache.k_pool[layer], self.cache.v_pool[layer]  # [Hkv, N, c, D]
        tp = self.num_prefill
        if tp == q.shape[0]:
            return prefill_attention(q, kp, vp, self.block_table, self.block_tokens, self.q_start, self.cu_q,
                                     self.scale, self.prefill_backend)
        assert self.ctx is not None
        if tp == 0:
            return decode_attention(q, kp, vp, self.ctx, self.scale, self.decode_backend)
        o = torch.empty_like(q)
        o[:tp] = prefill_attention(q[:tp], kp, vp, self.block_table, self.block_tokens, self.q_start,
                                   self.cu_q, self.scale, self.prefill_backend)
        o[tp:] = decode_attention(q[tp:], kp, vp, self.ctx, self.scale, self.decode_backend)
        return o


class ModelRunner:
    """Runs the model for a step plan and returns the logits of the rows that sample."""

    def __init__(self, model: CausalLM, cache: PrefixKVCache, decode_backend: str = "auto",
                 prefill_backend: str = "auto") -> None:
        self.model = model
        self.cache = cache
        self.decode_backend = decode_backend
        self.prefill_backend = prefill_backend
        self.scale = model.config.head_dim ** -0.5
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
        for req in plan.decodes:
            sample_rows.append(len(ids))
            sample_reqs.append(req)
            ids.append(req.output[-1])
            pos.append(len(req.prompt) + len(req.output) - 1)
        dev = self.cache.pool.device
        attn = StepAttention(self.cache, plan, self.decode_backend, self.prefill_backend, self.scale)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.tensor(pos, dtype=torch.long, device=dev), attn)  # [T, H]
        self.tokens_computed += len(ids)
        if not sample_rows:
            return hidden.new_zeros(0, 0, dtype=torch.float32), []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows)), sample_reqs
