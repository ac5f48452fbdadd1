"""A decode layer's attention in one foreign call on CPUs (``csrc/decode_cpu.cpp: cs_decode_layer``).

A decode step whose context has no shared run is, per layer: write every row's new K/V into its pool
slot, then attend each row over its own table of chunks (the in-place kernel). Through torch that is
about a dozen aten ops and a ctypes call with 21 arguments per layer, some 80 us of Python per layer
on a 2-core EPYC: more than the attention itself at short contexts, and a fifth of a batch-1 int4
step. Here the step's constant half (chunk tables, slots, launch parameters, scratch) is prepared once
per step in a ctypes struct; each layer is then one call with ten arguments that writes K/V, scales q,
runs the kernel and writes the output in the activations' dtype. The results are the same sums in the
same order as the unfused path (`tpp_decode_torch` with no runs): bitwise equal.

With shared runs (TPP) the same call also runs phase 1 (`cs_run_attention`: each run's stacked queries against
its chunks) into partial slots, the private pass into one more, and merges them per row by log-sum-exp in C
(what `tpp_decode_torch`'s zero/fill, `run_attention`, private pass, `combine_partials` and copy did in a dozen
aten ops per layer); the merge's `exp` is libm's, so results match the unfused path to float rounding.
"""

from __future__ import annotations

import ctypes

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.cpu_kernel import (
    DTYPE_CODES,
    MAX_CHUNK,
    MAX_GROUP,
    MAX_HEAD_DIM,
    CpuDecodeKernel,
    launch_params,
    load_cpu_kernel,
    run_launch_params,
)
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.kernels.tpp_torch import memo_private_table, memo_run_table

ACT_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_SLOTS = 64  # kMaxSlots of the source: partials merged per row (shared runs + the private pass)


class _Plan(ctypes.Structure):
    """Mirror of ``CsLayerPlan`` in ``csrc/decode_cpu.cpp``."""

    _fields_ = [("act_dtype", ctypes.c_int64), ("pool_dtype", ctypes.c_int64), ("hs", ctypes.c_int64),
                ("cs", ctypes.c_int64), ("table", ctypes.c_void_p), ("tokens", ctypes.c_void_p),
                *[(n, ctypes.c_int64) for n in ("b", "hkv", "g", "d", "c", "P", "cps", "nsplit")],
                ("so", ctypes.c_void_p), ("slse", ctypes.c_void_p), ("qbuf", ctypes.c_void_p),
                ("obuf", ctypes.c_void_p), ("scale", ctypes.c_double), ("nthreads", ctypes.c_int64),
                ("nwrite", ctypes.c_int64), ("slots", ctypes.c_void_p), ("write_rows", ctypes.c_void_p),
                ("R", ctypes.c_int64), ("run_rows", ctypes.c_void_p), ("run_cptr", ctypes.c_void_p),
                ("run_chunks", ctypes.c_void_p), ("run_tokens", ctypes.c_void_p), ("run_nsplit", ctypes.c_int64),
                ("run_mmax", ctypes.c_int64), ("run_threads", ctypes.c_int64), ("run_so", ctypes.c_void_p),
                ("run_slse", ctypes.c_void_p), ("part_o", ctypes.c_void_p), ("part_lse", ctypes.c_void_p),
                ("has_private", ctypes.c_int64)]


def _heads_contiguous(t: torch.Tensor, d: int) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == d


class FusedDecodeLayer:
    """One step's fused decode layer; call it per layer as ``(q, k, v, k_pool_l, v_pool_l) -> o``.

    q: [b, Hq, D], k, v: [T, Hkv, D] (fp32 or bf16, rows of any stride, heads contiguous); pools
    [Hkv, N, c, D]; o: [b, Hq, D] new, q's dtype. Every layer of the step must have layer 0's shapes,
    dtypes and strides (the model's layers do).
    """

    def __init__(self, kern: CpuDecodeKernel, plan: _Plan, keep: tuple[torch.Tensor, ...], shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self._fn = kern.decode_layer
        self._plan = plan
        self._plan_ref = ctypes.byref(plan)
        # for a caller that runs the layers itself (`workers/step_program.py`): cs_decode_layer and its plan
        self.fn_addr: int = ctypes.cast(kern.decode_layer, ctypes.c_void_p).value or 0
        self.plan_addr: int = ctypes.addressof(plan)
        self._keep = keep  # the tensors the plan points into
        self._shape, self._dtype = shape, dtype

    @staticmethod
    def build(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
              ctx: ChunkContext, slots: torch.Tensor, write_rows: torch.Tensor | None, scale: float,
              ws: Workspace) -> FusedDecodeLayer | None:
        """The fused layer for this step, or None when the call is not of the form it serves."""
        if ctx.num_runs + 1 > MAX_SLOTS or q.device.type != "cpu" or k_pool_l.device.type != "cpu":
            return None
        kern = load_cpu_kernel()
        if kern is None:
            return None
        hkv, _n, c, d = k_pool_l.shape
        b, hq = q.shape[0], q.shape[1]
        g = hq // hkv
        if (q.dtype not in ACT_CODES or k.dtype != q.dtype or v.dtype != q.dtype or k_pool_l.dtype not in DTYPE_CODES
                or v_pool_l.dtype != k_pool_l.dtype or k_pool_l.stride() != v_pool_l.stride()
                or g * hkv != hq or g > MAX_GROUP or c > MAX_CHUNK or d > MAX_HEAD_DIM or d % kern.vector_width
                or k_pool_l.stride(3) != 1 or k_pool_l.stride(2) != d or k_pool_l.stride(1) != c * d
                or not all(_heads_contiguous(t, d) for t in (q, k, v)) or k.shape[1] != hkv or v.shape[1] != hkv
                or b != ctx.batch_size or slots.dtype != torch.int64 or not slots.is_contiguous()):
            return None
        nwrite = slots.shape[0]
        if write_rows is not None:
            if write_rows.dtype != torch.int64 or not write_rows.is_contiguous() or write_rows.shape[0] != nwrite:
                return None
        elif nwrite > k.shape[0]:
            return None
        table, tokens, counts = memo_private_table(ctx, ws)  # int32 [b, P], contiguous
        p = table.shape[1]
        threads, cps, nsplit = launch_params(b, hkv, d, c, p)
        f32, dev = torch.float32, q.device
        qbuf = ws.take("cpul_q", (b, hkv, g, d), f32, dev)
        if ctx.num_runs and not kern.supports_runs(qbuf, k_pool_l):
            return None
        obuf = ws.take("cpul_o", (b, hkv, g, d), f32, dev)
        so = ws.take("cpul_so", (b, hkv, nsplit, g, d), f32, dev) if nsplit > 1 else None
        slse = ws.take("cpul_slse", (b, hkv, nsplit, g), f32, dev) if nsplit > 1 else None
        plan = _Plan(act_dtype=ACT_CODES[q.dtype], pool_dtype=DTYPE_CODES[k_pool_l.dtype], hs=k_pool_l.stride(0),
                     cs=k_pool_l.stride(1), table=table.data_ptr(), tokens=tokens.data_ptr(), b=b, hkv=hkv, g=g,
                     d=d, c=c, P=p, cps=cps, nsplit=nsplit, so=None if so is None else so.data_ptr(),
                     slse=None if slse is None else slse.data_ptr(), qbuf=qbuf.data_ptr(), obuf=obuf.data_ptr(),
                     scale=scale, nthreads=threads, nwrite=nwrite, slots=slots.data_ptr(),
                     write_rows=None if write_rows is None else write_rows.data_ptr())
        keep = [t for t in (table, tokens, qbuf, obuf, so, slse, slots, write_rows) if t is not None]
        if ctx.num_runs:  # TPP: phase 1 over the shared runs, the private pass, one merge (`cs_decode_layer`)
            keep += _plan_runs(plan, ctx, ws, max(counts, default=0) > 0)
        return FusedDecodeLayer(kern, plan, tuple(keep), (b, hq, d), q.dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool_l: torch.Tensor,
                 v_pool_l: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._shape, dtype=self._dtype)  # [b, Hq, D]
        rc = self._fn(self._plan_ref, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                      v.stride(0), k_pool_l.data_ptr(), v_pool_l.data_ptr(), out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"cs_decode_layer failed with code {rc}")
        return out


def _plan_runs(plan: _Plan, ctx: ChunkContext, ws: Workspace, has_private: bool) -> list[torch.Tensor]:
    """Fill the plan's shared-run half; returns the tensors it points into."""
    b, hkv, g, d, c = plan.b, plan.hkv, plan.g, plan.d, plan.c
    rt = memo_run_table(ctx, ws)
    threads, nsplit, mmax = run_launch_params(rt, hkv, g, d, c)
    n, f32, cpu = ctx.num_runs, torch.float32, torch.device("cpu")
    part_o = ws.take("cpul_part_o", (n + 1, b, hkv, g, d), f32, cpu)
    part_lse = ws.take("cpul_part_lse", (n + 1, b, hkv, g), f32, cpu)
    keep = [rt.rows, rt.cptr, rt.chunks, rt.tokens, part_o, part_lse]
    if nsplit > 1:
        keep += [ws.take("cpul_run_so", (n, hkv, nsplit, mmax, d), f32, cpu),
                 ws.take("cpul_run_slse", (n, hkv, nsplit, mmax), f32, cpu)]
        plan.run_so, plan.run_slse = keep[-2].data_ptr(), keep[-1].data_ptr()
    plan.R, plan.run_rows, plan.run_cptr = n, rt.rows.data_ptr(), rt.cptr.data_ptr()
    plan.run_chunks, plan.run_tokens = rt.chunks.data_ptr(), rt.tokens.data_ptr()
    plan.run_nsplit, plan.run_mmax, plan.run_threads = nsplit, mmax, threads
    plan.part_o, plan.part_lse, plan.has_private = part_o.data_ptr(), part_lse.data_ptr(), int(has_private)
    return keep
