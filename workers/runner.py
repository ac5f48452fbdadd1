"""ModelRunner: turns a `StepPlan` into one model forward over the flattened tokens of the step.

Rows are laid out as [prefill pieces..., decode rows in tree order]. The per-layer attention
(`StepAttention`) first scatters the step's new K/V into their pool slots, then runs prefill
attention over each piece's cached prefix and TPP decode attention over the decode rows. On CPUs a
decode-only step does both in one kernel call per layer (`kernels/cpu_layer.py`; TPP's phases and merge too).
Everything that is the same for all layers (slot indices, prefill tables, the decode context) is
built once per step in host memory and reaches the device in the step's one copy (`Staging`); the
step reads nothing back from the device. The decode kernels reuse one scratch `Workspace` across
layers and steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from chunkserve.kernels.api import DecodeFn, check_decode_inputs, get_decode_fn, resolve_backend
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.cpu_layer import FusedDecodeLayer
from chunkserve.kernels.prefill import PrefillTables, prefill_step
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.kvcontext import HostContext
from chunkserve.workers.model import CausalLM
from chunkserve.workers.scheduler import Request, StepPlan
from chunkserve.workers.staging import Staging
from chunkserve.workers.step_program import DecodeLayers

# stage(staging, sampling requests) -> bind(flushed tensors): lets the sampler ride the step's copy
SampleStager = Callable[[Staging, list[Request]], Callable[[list[torch.Tensor]], Any]]


class StepInputs:
    """A step's host-built metadata, staged for one copy: token ids, positions, K/V slots, the rows
    that write K/V and that sample, prefill tables and the decode context."""

    def __init__(self, cache: PrefixKVCache, plan: StepPlan, staging: Staging) -> None:
        c = cache.chunk_size
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        self.sample_reqs: list[Request] = []
        write_rows: list[int] = []
        for piece in plan.prefills:
            if piece.write:
                write_rows += range(len(ids), len(ids) + len(piece.tokens))
            ids += piece.tokens
            pos += range(piece.start, piece.start + len(piece.tokens))
            if piece.samples:
                sample_rows.append(len(ids) - 1)
                self.sample_reqs.append(piece.req)
        self.num_prefill = base = len(ids)
        if plan.decodes:
            sample_rows += range(base, base + len(plan.decodes))
            self.sample_reqs += plan.decodes
            write_rows += range(base, base + len(plan.decodes))
            ids += [req.output[-1] for req in plan.decodes]
            pos += [len(req.prompt) + len(req.output) - 1 for req in plan.decodes]
        self.num_tokens = len(ids)
        self.num_sample = len(sample_rows)
        self._i: dict[str, int] = {"ids": staging.add(ids), "pos": staging.add(pos)}
        # flat slot of every new token in a layer's pool viewed as [Hkv, N*c, D]
        slots = np.asarray(plan.slot_chunks, dtype=np.int64) * c + np.asarray(plan.slot_offsets, dtype=np.int64)
        self._i["slots"] = staging.add(slots)  # [T_write]
        # rows that write K/V (all but the logits-only rows of fully cached prompts)
        if len(write_rows) < len(ids):
            self._i["write_rows"] = staging.add(write_rows)
        if sample_rows and len(sample_rows) < len(ids):
            self._i["sample_rows"] = staging.add(sample_rows)
        self._prefill_host: tuple | None = None
        if plan.prefills:
            tables = [cache.seq_chunks(p.req.sid) for p in plan.prefills]
            width = max(len(t) for t in tables)
            bt = np.zeros((len(tables), width), dtype=np.int32)
            btok = np.zeros((len(tables), width), dtype=np.int32)
            for r, (t, p) in enumerate(zip(tables, plan.prefills, strict=True)):
                n = len(t)
                bt[r, :n] = t
                btok[r, :n - 1] = c
                btok[r, n - 1] = cache.seq_len(p.req.sid) - c * (n - 1)
            starts = [p.start for p in plan.prefills]
            cu = [0]
            for p in plan.prefills:
                cu.append(cu[-1] + len(p.tokens))
            arrays = PrefillTables.host_arrays(bt, btok, starts, cu)  # checked here, on the host
            self._prefill_host = (bt, btok, starts, cu, {k: staging.add(a, a.dtype.type) for k, a in arrays.items()})
        self.host_ctx: HostContext | None = plan.decode_ctx  # type: ignore[assignment]
        self._ctx_idx: list[int] | None = None
        if self.host_ctx is not None and not staging.on_host:
            self._ctx_idx = self.host_ctx.stage(staging)
        self.t: dict[str, torch.Tensor] = {}
        self.prefill: PrefillTables | None = None
        self.ctx: ChunkContext | None = None

    def bind(self, tensors: list[torch.Tensor], cache: PrefixKVCache) -> None:
        """Take the device tensors of the flushed copy."""
        self.t = {k: tensors[i] for k, i in self._i.items()}
        if self._prefill_host is not None:
            bt, btok, starts, cu, idx = self._prefill_host
            self.prefill = PrefillTables(bt, btok, starts, cu, **{k: tensors[i] for k, i in idx.items()})
        if self.host_ctx is not None:
            if self._ctx_idx is not None:
                self.ctx = self.host_ctx.from_tensors(tensors, self._ctx_idx)
            else:  # CPU: the cache's zero-copy context
                self.ctx = cache.device_context(self.host_ctx)


class StepAttention:
    """The `AttentionFn` of one step: K/V writes + prefill attention + decode attention."""

    def __init__(self, cache: PrefixKVCache, inputs: StepInputs, decode_backend: str, prefill_backend: str,
                 scale: float, workspace: Workspace | None = None, pools: PoolViews | None = None) -> None:
        self.cache = cache
        self.pools = pools if pools is not None else PoolViews(cache)
        self.scale = scale
        self.decode_backend = decode_backend
        self._decode_fn: DecodeFn | None = None  # resolved on the first decode layer of the step
        self.prefill_backend = prefill_backend
        self.workspace = workspace
        if workspace is not None:
            workspace.new_step()  # contexts' token counts are refreshed in place between steps
        self.slots = inputs.t["slots"]  # [T_write] int64
        self.write_rows: torch.Tensor | None = inputs.t.get("write_rows")  # [T_write] int64 or None (all)
        self.num_prefill = inputs.num_prefill
        self.ctx: ChunkContext | None = inputs.ctx
        self.prefill_tables = inputs.prefill
        # decode-only steps on CPUs: K/V writes + attention (shared runs, private pass, merge) in one call per layer
        # (decided on layer 0; False = not this step)
        self._fused: FusedDecodeLayer | bool | None = None

    def fusable(self) -> bool:
        """Whether this step may run as one-call decode layers (decode rows only, on the CPU torch path)."""
        return (self.num_prefill == 0 and self.ctx is not None and not self.cache.pending_copies
                and self.decode_backend in ("auto", "torch") and self.pools.k_pool.device.type == "cpu")

    def _fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor,
              vp: torch.Tensor) -> FusedDecodeLayer | bool:
        self._fused = False
        if self.fusable() and self.ctx is not None:
            check_decode_inputs(q, kp, vp, self.ctx.batch_size)
            self._fused = FusedDecodeLayer.build(q, k, v, kp, vp, self.ctx, self.slots, self.write_rows,
                                                 self.scale, self.workspace or Workspace()) or False
        return self._fused

    def fused_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> DecodeLayers | None:
        """This step's one-call attention layer and every layer's pools, for a model that runs its layer
        loop itself (`workers/step_program.py`), or None when the step is not of that form. q: [b, Hq, D],
        k, v: [b, Hkv, D]: the buffers the model will fill (their shapes and strides are checked)."""
        fused = self._fuse(q, k, v, self.pools.k[0], self.pools.v[0])
        if not isinstance(fused, FusedDecodeLayer):
            return None
        return DecodeLayers(fused, self.pools.k_addrs, self.pools.v_addrs)

    def _prefill(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        assert self.prefill_tables is not None
        return prefill_step(q, kp, vp, self.prefill_tables, self.scale, self.prefill_backend)
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
        # decided once per step: on layer 0, unless `fused_decode` already tried (a model's program declined)
        fused = self._fused if layer or self._fused is not None else self._fuse(q, k, v, kp, vp)
        if fused:
            return fused(q, k, v, kp, vp)  # type: ignore[operator]
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
        self.k_addrs = np.array([t.data_ptr() for t in self.k], dtype=np.int64)  # [L]
        self.v_addrs = np.array([t.data_ptr() for t in self.v], dtype=np.int64)

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
        self.staging = Staging(cache.pool.device)  # the step's host metadata, one copy per step
        self.sample_stager: SampleStager | None = None
        self.sample_job: Any = None  # what sample_stager's bind returned for the last step
        self.tokens_computed = 0  # total tokens run through the model (prefill + decode)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request]]:
        """Forward the step; returns (logits [n, V] fp32, the n requests that sample, in row order).

        ``sample_stager`` (set by the engine) stages the sampler's per-row knobs into the same copy.
        """
        if not self.pools.current(self.cache):
            self.pools = PoolViews(self.cache)
        inputs = StepInputs(self.cache, plan, self.staging)
        bind_sampler = None
        if self.sample_stager is not None and inputs.sample_reqs:
            bind_sampler = self.sample_stager(self.staging, inputs.sample_reqs)
        tensors = self.staging.flush()  # the step's one host -> device copy (none on the CPU)
        inputs.bind(tensors, self.cache)
        self.sample_job = bind_sampler(tensors) if bind_sampler is not None else None
        attn = StepAttention(self.cache, inputs, self.decode_backend, self.prefill_backend, self.scale,
                             self.workspace, self.pools)
        keep = inputs.t.get("sample_rows")  # [n]: the rows that sample (None: every row)
        if not inputs.sample_reqs:
            keep = torch.zeros(0, dtype=torch.long, device=inputs.t["ids"].device)
        hidden = self.model.forward(inputs.t["ids"], inputs.t["pos"], attn, keep=keep)  # [n, H]
        self.tokens_computed += inputs.num_tokens
        if not inputs.sample_reqs:
            return hidden.new_zeros(0, 0, dtype=torch.float32), []
        return self.model.compute_logits(hidden), inputs.sample_reqs
