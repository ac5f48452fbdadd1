"""The matmuls of the forward: plain, oneDNN-prepacked and weight-only int8 linears.

Every builder returns a `LinearFn` ``x [T, K] -> y [T, N]`` with its weight (and bias) bound, so the
layer loop makes one Python call per matmul whatever the back-end:

* `plain_linear`: ``F.linear``'s ``mm`` (MKL's GEMV for one fp32 row on one thread, which beats
  oneDNN's blocked kernel and its ~25 us per-call cost there).
* `packed_linear`: the weight reordered once into oneDNN's blocked layout (CPU fp32/bf16; everything
  else, ``F.linear`` would re-pack a bf16 weight on every call).
* `int8_linear`: per-output-channel symmetric int8 weights (`Int8Weight`; ``quantization="int8"`` on
  models whose input sizes are not multiples of 32, else it runs Q8_0 blocks), dequantised inside
  ATen's ``_weight_int8pack_mm`` on the CPU. That kernel is vectorised for bf16 activations only (its
  fp32 path is scalar, ~4x slower on AVX2), so fp32 activations go through it in bf16 and come back
  as fp32. Elsewhere the weight is dequantised per call and multiplied with ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from chunkserve.workers.engine_config import QUANT_MODES as QUANT_MODES  # one list, torch-free (re-exported)

LinearFn = Callable[[torch.Tensor], torch.Tensor]  # x: [T, K] -> y: [T, N]
_INT8_MAX = 127


def plain_linear(w: torch.Tensor, b: torch.Tensor | None) -> LinearFn:
    """``F.linear`` with w: [N, K], b: [N] or None bound, called as the ``mm``/``addmm`` it dispatches to
    for 2-D inputs (same kernel and result, a third of the dispatch layers)."""
    if w.dim() != 2:
        return partial(F.linear, weight=w, bias=b)
    wt = w.t()  # [K, N] view
    if b is None:
        return partial(torch.mm, mat2=wt)
    return partial(torch.addmm, b, mat2=wt)


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this ATen build can reorder and run oneDNN-blocked linear weights of `dtype` here."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or bool(mkldnn._is_mkldnn_bf16_supported())


def pack_weight(w: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """w: [N, K] -> an opaque oneDNN-blocked tensor for `packed_linear` (raises RuntimeError if unsupported)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)


def packing_matches_f_linear(dtype: torch.dtype, batch_hint: int) -> bool:
    """Whether a packed weight gives ``F.linear``'s result here (bf16: bitwise; fp32: to rounding), on a probe.
    Raises RuntimeError where ATen lacks the oneDNN ops."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 64, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
    probe = torch.randn(3, 64, generator=g).to(dtype)
    got, want = packed_linear(pack_weight(w, batch_hint), b)(probe), F.linear(probe, w, b)
    return torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, 1e-4, 1e-5)


def packed_linear(w_packed: torch.Tensor, b: torch.Tensor | None) -> LinearFn:
    """oneDNN linear over a weight from `pack_weight`; b: [N] or None."""
    op = torch.ops.mkldnn._linear_pointwise

    def run(x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        return op(x, w_packed, b, "none", [], "")

    return run


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight as int8 values and one scale per output channel: w[n] ~= q[n] * scale[n].

    q: [N, K] int8 in [-127, 127]; scale: [N] in the dtype the matmul kernel consumes (bf16 on the
    CPU). Quantised against the *stored* (rounded) scale, so the rounding of the scale adds no
    per-channel bias: every dequantised value is within scale/2 of the original (within 1/254 of
    the row's max magnitude, plus at most 2^-9 of it where the rounded scale clips the extreme).
    """

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N]

    @classmethod
    def quantize(cls, w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
        """Per-output-channel symmetric int8 of w: [N, K] (any float dtype)."""
        wf = w.detach().float()  # [N, K]
        amax = wf.abs().amax(dim=1)  # [N]
        scale = (amax / _INT8_MAX).to(scale_dtype)  # [N], rounded once
        denom = torch.where(scale > 0, scale.float(), torch.ones_like(amax))  # all-zero rows: q = 0
        q = torch.round(wf / denom[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)  # [N, K]
        return cls(q.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (computed in fp32, rounded once)."""
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)


def int8_linear(w: Int8Weight, b: torch.Tensor | None, dtype: torch.dtype) -> LinearFn:
    """Weight-only int8 linear; x: [T, K] in the model `dtype` -> y: [T, N] in `dtype`."""
    # ATen's CPU kernel reads K in steps of 16: other K give garbage or a crash (torch 2.13, measured)
    if w.q.device.type != "cpu" or not hasattr(torch.ops.aten, "_weight_int8pack_mm") or w.q.shape[1] % 16:
        scale = w.scale.to(dtype)

        def dequant_run(x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
            return F.linear(x, w.q.to(dtype) * scale[:, None], b)

        return dequant_run
    op = torch.ops.aten._weight_int8pack_mm
    kdt = w.scale.dtype  # the kernel's activation dtype

    def run(x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        y = op(x.to(kdt), w.q, w.scale)  # [T, N] in kdt
        if y.dtype != dtype:
            y = y.to(dtype)
        return y if b is None else y.add_(b)

    return run
