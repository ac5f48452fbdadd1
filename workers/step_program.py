"""A decode step's layer loop as one foreign call, for block-quantised models on CPUs (``csrc/qmatmul.cpp: cs_q_run``).

With the fused int4 layers (`StepPrograms.bind`) a decode layer is five foreign calls: qkv (RMSNorm in,
RoPE out), the one-call attention layer (K/V writes + attention, TPP's phases and merge included,
`kernels/cpu_layer.py`), o (added into the residual), gate/up (RMSNorm in) and down (SwiGLU in, added into
the residual). Made from Python, each
call costs its argument checks, a fresh output tensor and a ctypes call with a dozen arguments: about
40 us per layer on a 2-core EPYC, a tenth of a batch-1 SmolLM2 step. A `StepProgram` holds the calls of
every layer for one batch size as a table of int64 records over buffers it owns, built once; a step then
fills the embedding rows and the RoPE factors into those buffers, writes the step's attention plan into
the table and makes one call. The calls and their arguments are the ones the Python loop makes, so the
results are bitwise the same (`tests/workers/test_step_program.py`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from chunkserve.kernels.cpu_layer import FusedDecodeLayer
from chunkserve.workers.arena import WeightArena
from chunkserve.workers.quant import (
    BLOCK,
    B16Weight,
    BlockLinear,
    BlockWeight,
    QKernel,
    fused_block_linear,
    load_kernel,
)

OP_WORDS = 16  # kOpWords of the source
LINEAR, CALL = 0, 1
MAX_PROGRAMS = 16  # programs kept per model (by batch size and thread count, most recently used; ~0.2 ms to build)
# bf16 models: decode steps of at most this many rows run through `B16Weight` copies of the layers (a step of
# few rows reads every weight once, which the kernel does at memory speed; up to 16 rows its tiles of up to 16
# rows beat oneDNN's blocked bf16 kernel, one call and all, and from about 24 rows oneDNN is faster:
# `benchmarks/bench_step.py`, docs/benchmarks.md)
BF16_PROGRAM_ROWS = 16


@dataclass(frozen=True)
class DecodeLayers:
    """What `StepAttention.fused_decode` hands over: the step's attention layer and each layer's pool
    addresses (int64 [L], K and V)."""

    layer: FusedDecodeLayer
    k_pools: np.ndarray
    v_pools: np.ndarray


class StepProgram:
    """The layer loop of `CausalLM.forward` over ``t`` rows (fused block-quantised layers), as one call.

    Buffers (model dtype): h [t, H] (the residual stream: fill it, run, read it), qkv [t, (Hq + 2 Hkv) D],
    o [t, Hq D], gu [t, 2 I], cos / sin [t, 1, D]. ``q``, ``k``, ``v`` are the views of qkv the attention
    layer reads (for `StepAttention.fused_decode` to check)."""

    def __init__(self, fns: list[tuple[BlockLinear, ...]], t: int, hidden: int, heads: tuple[int, int, int],
                 dtype: torch.dtype) -> None:
        hq, hkv, d = heads
        self.t, self.threads = t, torch.get_num_threads()
        self.kern: QKernel = fns[0][0].kern
        f_qkv0, _, f_gu0, _ = fns[0]
        self.h = torch.empty(t, hidden, dtype=dtype)
        self.qkv = torch.empty(t, f_qkv0.n, dtype=dtype)  # [t, (Hq + 2 Hkv) * D]
        self.o = torch.empty(t, hq * d, dtype=dtype)
        self.gu = torch.empty(t, f_gu0.n, dtype=dtype)  # [t, 2 I]
        self.cos = torch.empty(t, 1, d, dtype=dtype)
        self.sin = torch.empty(t, 1, d, dtype=dtype)
        qkv3 = self.qkv.view(t, hq + 2 * hkv, d)
        self.q, self.k, self.v = qkv3[:, :hq], qkv3[:, hq:hq + hkv], qkv3[:, hq + hkv:]
        n_layers = len(fns)
        ops = np.zeros((5 * n_layers, OP_WORDS), dtype=np.int64)
        h, qkv, o, gu = (x.data_ptr() for x in (self.h, self.qkv, self.o, self.gu))
        width = self.qkv.shape[1]

        def linear(row: int, f: BlockLinear, x: int, ldx: int, y: int, ldy: int, acc: int, rope: bool) -> None:
            ops[row, :14] = (LINEAR, f.addr, x, f.xcode, t, ldx, y, ldy, acc,
                             self.cos.data_ptr() if rope else 0, self.sin.data_ptr() if rope else 0,
                             (hq + hkv) * d if rope else 0, d if rope else 0, f.threads_for(t))

        for i, (f_qkv, f_o, f_gu, f_down) in enumerate(fns):
            r = 5 * i
            linear(r, f_qkv, h, hidden, qkv, width, 0, True)  # qkv = RoPE(RMSNorm(h) . W_qkv^T)
            # r + 1: the attention layer: (fn, plan) per step, pools per cache
            ops[r + 1, :12] = (CALL, 0, 0, qkv, width, qkv + hq * d * self.qkv.element_size(), width,
                               qkv + (hq + hkv) * d * self.qkv.element_size(), width, 0, 0, o)
            linear(r + 2, f_o, o, hq * d, h, hidden, 1, False)  # h += o . W_o^T
            linear(r + 3, f_gu, h, hidden, gu, self.gu.shape[1], 0, False)  # gu = RMSNorm(h) . W_gu^T
            linear(r + 4, f_down, gu, self.gu.shape[1], h, hidden, 1, False)  # h += SwiGLU(gu) . W_down^T
        self._ops = ops
        self._attn_rows = np.arange(1, 5 * n_layers, 5)
        self._failed = ctypes.c_int64(-1)

    def matches(self, t: int) -> bool:
        """Whether this program serves a step of ``t`` rows now (the thread count is part of the table)."""
        return self.t == t and self.threads == torch.get_num_threads()

    def run(self, layers: DecodeLayers) -> torch.Tensor:
        """Run every layer over ``h`` (filled by the caller) with this step's attention; returns ``h``."""
        ops, rows = self._ops, self._attn_rows
        ops[rows, 1] = layers.layer.fn_addr
        ops[rows, 2] = layers.layer.plan_addr
        ops[rows, 9] = layers.k_pools
        ops[rows, 10] = layers.v_pools
        rc = self.kern.run(ops.ctypes.data, ops.shape[0], ctypes.byref(self._failed))
        if rc != 0:
            i = int(self._failed.value)
            raise RuntimeError(f"decode step failed in layer {i // 5}, call {i % 5} with code {rc}")
        return self.h


class LayerLike(Protocol):
    """`model.LayerWeights` as seen here."""

    @property
    def ln1(self) -> torch.Tensor: ...

    @property
    def ln2(self) -> torch.Tensor: ...

    def matmuls(self) -> tuple[tuple[Any, torch.Tensor | None], ...]: ...


class StepPrograms:
    """A model's fused block-quantised layers (``fns``) and its `StepProgram`s by batch size; `forward` runs
    a step through one when the step allows."""

    def __init__(self, fns: list[tuple[BlockLinear, ...]], hidden: int, heads: tuple[int, int, int],
                 dtype: torch.dtype) -> None:
        self.fns = fns  # per layer: (qkv, o, gate_up, down)
        self.head: BlockLinear | None = None  # bf16: the lm_head for few rows (fp32 logits), see `bind_bf16`
        self._hidden, self._heads, self._dtype = hidden, heads, dtype
        self._programs: dict[tuple[int, int], StepProgram] = {}  # by (rows, threads)
        self.arena: WeightArena | None = None  # the weights in one block, in program order (`gather`)

    @classmethod
    def bind(cls, layers: Sequence[LayerLike], eps: float, hidden: int, heads: tuple[int, int, int],
             dtype: torch.dtype) -> StepPrograms | None:
        """For block-quantised layers with the kernel available: per layer (qkv with RMSNorm ln1 in, o,
        gate_up with RMSNorm ln2 in, down with SwiGLU in); o and down add into the residual (`f(x, h)`).
        None otherwise."""
        if not layers or not all(isinstance(w, BlockWeight) for lw in layers for w, _ in lw.matmuls()):
            return None
        out: list[tuple[BlockLinear, ...]] = []
        for lw in layers:
            (w_qkv, b_qkv), (w_o, b_o), (w_gu, b_gu), (w_down, b_down) = lw.matmuls()
            fns = (fused_block_linear(w_qkv, b_qkv, dtype, norm=(lw.ln1, eps)), fused_block_linear(w_o, b_o, dtype),
                   fused_block_linear(w_gu, b_gu, dtype, norm=(lw.ln2, eps)),
                   fused_block_linear(w_down, b_down, dtype, glu=True))
            if any(f is None for f in fns):
                return None
            out.append(tuple(f for f in fns if f is not None))
        return cls(out, hidden, heads, dtype)

    @classmethod
    def bind_bf16(cls, layers: Sequence[LayerLike], lm_head: object, eps: float, hidden: int,
                  heads: tuple[int, int, int]) -> StepPrograms | None:
        """`bind` over `B16Weight` copies of dense bf16 CPU layers, for decode steps of at most
        `BF16_PROGRAM_ROWS` rows, and ``head`` over the lm_head [V, H] if dense bf16 (fp32 logits); None without
        the kernel's native bf16 dot product (AVX512-BF16) or for other weights. The copies cost those
        weights once more in memory (2 bytes a parameter)."""
        kern = load_kernel()
        mm = [lw.matmuls() for lw in layers]
        if kern is None or not kern.native_bf16 or not all(
                isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                and w.dim() == 2 and w.shape[1] % BLOCK == 0 for m in mm for w, _ in m):
            return None
        b16 = [_Layer(lw.ln1, lw.ln2, tuple((B16Weight.quantize(w), b) for w, b in m))
               for lw, m in zip(layers, mm, strict=True)]
        progs = cls.bind(b16, eps, hidden, heads, torch.bfloat16)
        if progs is not None and isinstance(lm_head, torch.Tensor) and lm_head.dtype == torch.bfloat16 \
                and lm_head.dim() == 2 and lm_head.shape[1] % BLOCK == 0:
            progs.head = BlockLinear(kern, B16Weight.quantize(lm_head), None, torch.bfloat16, torch.float32)
        if progs is not None:
            progs.gather()
        return progs

    def gather(self, *extra: object) -> None:
        """Lay the weights of every layer, then ``head`` and the ``extra`` kernel calls (a model's lm_head), out
        in one `WeightArena`: a decode step then reads them as one stream (on huge pages where allowed)."""
        calls = [f for layer in self.fns for f in layer]
        calls += [c for c in (self.head, *extra) if isinstance(c, BlockLinear)]
        self.arena = WeightArena.gather(calls)

    def _get(self, t: int) -> StepProgram:
        key = (t, torch.get_num_threads())  # a served engine's threads change with its node's load
        prog = self._programs.pop(key, None)
        if prog is None or not prog.matches(t):
            prog = StepProgram(self.fns, t, self._hidden, self._heads, self._dtype)
        self._programs[key] = prog  # most recent last
        while len(self._programs) > MAX_PROGRAMS:
            del self._programs[next(iter(self._programs))]
        return prog

    def forward(self, attn: Any, embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The residual stream after every layer for a decode step (input_ids, positions: [T]; cos, sin:
        the model's [P, 1, D] RoPE tables), or None when ``attn`` does not offer one-call decode layers for
        this step (then the caller runs its own loop)."""
        fusable = getattr(attn, "fusable", None)
        if fusable is None or not fusable():
            return None
        prog = self._get(int(input_ids.shape[0]))
        layers = attn.fused_decode(prog.q, prog.k, prog.v)
        if layers is None:
            return None
        torch.index_select(embed, 0, input_ids, out=prog.h)  # [T, H]
        torch.index_select(cos, 0, positions, out=prog.cos)  # [T, 1, D]
        torch.index_select(sin, 0, positions, out=prog.sin)
        return prog.run(layers)


@dataclass(frozen=True)
class _Layer:
    """A `LayerLike` over other weights (`StepPrograms.bind_bf16`)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    mm: tuple[tuple[Any, torch.Tensor | None], ...]

    def matmuls(self) -> tuple[tuple[Any, torch.Tensor | None], ...]:
        return self.mm
