"""Block-quantised int4/int8 linears for the CPU (llama.cpp's Q4_1 and Q8_0), through ``csrc/qmatmul.cpp``.

`Q4Weight` (Q4_1): blocks of 32 along K, w = d * q + m with q in [0, 15] and fp16 d, m per block (5 bits
per weight). `Q8Weight` (Q8_0): blocks of 32, w = d * q with q in [-127, 127] and an fp16 d per block
(8.5 bits per weight). The embedded SmolLM2 GGUF stores its layers as Q4_1 and its tied embedding as Q8_0,
both in blocks of 32 along K, so re-quantising its dequantised weights gives back the GGUF's values.

`block_linear` multiplies with the activations quantised per row and per block of 32 to int8 (as
llama.cpp's Q8_1): one integer dot product per block (vpmaddubsw on AVX2). That is not weight-only: the
activation rounding is part of the quality `benchmarks/bench_quant.py` reports. Every output element is
the same sum in the same order whatever the batch and thread count (batch-invariant, deterministic).

The kernel is compiled with the system C++ compiler (``-O3 -march=native -fopenmp``, a few seconds) on
first use and cached under ``$CHUNKSERVE_CACHE/ext`` keyed by source, compiler and CPU flags; without a
compiler (or off the CPU) `block_linear` dequantises per call and uses ``F.linear`` (slow, but the same
weights; the activations then stay unquantised).

`B16Weight` is not a quantisation: dense bf16 weights in the same kernel (``csrc/b16.h``, weight type 2), so
that a bf16 model's decode steps of few rows run as one call (`step_program.StepPrograms.bind_bf16`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chunkserve import env
from chunkserve.kernels.cpu_kernel import bind_or_none, build_extension
from chunkserve.workers.linear import LinearFn

SOURCE = Path(__file__).with_name("csrc") / "qmatmul.cpp"
BLOCK = 32
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SERIAL_WORK = 1 << 17  # int8 multiply-adds (M * N * K) below which one thread does the call


@dataclass(frozen=True)
class Q4Weight:
    """Q4_1 weight of logical shape [N, K]: q [N, K/2] uint8 (two 4-bit values a byte, llama.cpp's order:
    byte j of a block holds element j low and element j + 16 high), d and m [N, K/32] fp16."""

    q: torch.Tensor  # [N, K/2] uint8
    d: torch.Tensor  # [N, K/32] fp16
    m: torch.Tensor  # [N, K/32] fp16

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Q4Weight:
        """w: [N, K] (K % 32 == 0), any float dtype. Per block: m = min, d = (max - min) / 15, both rounded to
        fp16 first, then q = round((w - m) / d) clamped to [0, 15] against the stored values."""
        n, k = _check_shape(w)
        wf = w.detach().float().reshape(n, k // BLOCK, BLOCK)  # [N, B, 32]
        lo, hi = wf.amin(-1), wf.amax(-1)  # [N, B]
        m = lo.half()
        d = ((hi - m.float()) / 15).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))  # constant blocks: q = 0
        q = torch.round((wf - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)  # [N, B, 32]
        packed = q[..., :16] | (q[..., 16:] << 4)  # [N, B, 16]
        return cls(packed.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.q.shape[1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (computed in fp32, rounded once)."""
        n, k = self.shape
        p = self.q.reshape(n, k // BLOCK, 16)
        q = torch.cat((p & 0x0F, p >> 4), -1).float()  # [N, B, 32]
        w = q * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(n, k).to(dtype)


@dataclass(frozen=True)
class Q8Weight:
    """Q8_0 weight [N, K]: q [N, K] int8 in [-127, 127], d [N, K/32] fp16 (d = amax / 127 per block)."""

    q: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K/32] fp16

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Q8Weight:
        n, k = _check_shape(w)
        wf = w.detach().float().reshape(n, k // BLOCK, BLOCK)  # [N, B, 32]
        d = (wf.abs().amax(-1) / 127).half()  # [N, B]
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        q = torch.round(wf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k).contiguous(), d.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        w = self.q.reshape(n, k // BLOCK, BLOCK).float() * self.d.float()[..., None]
        return w.reshape(n, k).to(dtype)


@dataclass(frozen=True)
class B16Weight:
    """A dense bf16 weight [N, K] (K % 32 == 0) for the same kernel (``csrc/b16.h``): not quantised, laid out
    so that a decode step's rows read it in one pass, with the layer's norm, SwiGLU, RoPE and residual add in
    the call (`StepPrograms`), as the block-quantised weights are."""

    q: torch.Tensor  # [N, K] bf16

    @classmethod
    def quantize(cls, w: torch.Tensor) -> B16Weight:
        _check_shape(w)
        return cls(w.detach().to(torch.bfloat16).contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.to(dtype)


BlockWeight = Q4Weight | Q8Weight | B16Weight


def _check_shape(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"block quantisation needs a 2-D weight with K a multiple of {BLOCK}; got {tuple(w.shape)}")
    return int(w.shape[0]), int(w.shape[1])


def pack(w: BlockWeight) -> torch.Tensor:
    """The kernel's layout of ``w`` (see "Packed weights" in ``csrc/qmatmul.cpp``): uint8 [ceil(N/8), K/32, bytes],
    groups of 8 rows (zero rows pad N), each block's quants as 4-byte lanes, one lane per row (Q8_0 offset by
    128), then the
    rows' fp16 scales (and Q4_1 minima); bf16 weights as 16 pairs of each row's values a block (512 bytes)."""
    n, k = w.shape
    nb, g = k // BLOCK, -(-n // 8)

    def rows8(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [G * 8, ...], zero rows appended
        return torch.cat((t, t.new_zeros(g * 8 - n, *t.shape[1:]))) if g * 8 != n else t

    if isinstance(w, B16Weight):  # [G, B, 16 pairs x 8 lanes x 2 values] as bytes
        return rows8(w.q).view(g, 8, nb, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(g, nb, 512)
    if isinstance(w, Q4Weight):
        q = rows8(w.q).view(g, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 128)  # [G, B, 4 x 8 lanes x 4]
        tail = [rows8(t).view(g, 8, nb).permute(0, 2, 1).contiguous().view(torch.uint8) for t in (w.d, w.m)]
    else:
        q = (rows8(w.q).to(torch.int16) + 128).to(torch.uint8)  # offset binary: q + 128 (see the source)
        q = q.view(g, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 256)
        tail = [rows8(w.d).view(g, 8, nb).permute(0, 2, 1).contiguous().view(torch.uint8)]
    return torch.cat([q, *tail], -1).contiguous()  # [G, B, 160] or [G, B, 272]


def build(force: bool = False) -> Path:
    """Compile ``csrc/qmatmul.cpp`` for this CPU (or reuse the cached build); RuntimeError when it cannot."""
    return build_extension("qmatmul", (SOURCE,), force)


class _CsQWeight(ctypes.Structure):
    """``CsQWeight`` of the source: the constant arguments of one bound weight."""

    _fields_ = [("wtype", ctypes.c_int32), ("ydtype", ctypes.c_int32), ("packed", ctypes.c_void_p),
                ("bias", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("norm_w", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("glu", ctypes.c_int32)]


class QKernel:
    """ctypes binding of ``cs_q_linear`` and ``cs_q_run`` (a list of calls, `workers/step_program.py`)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.cs_q_abi_version() != 8:
            raise RuntimeError(f"{path} has an unexpected ABI version")
        fn = lib.cs_q_linear
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn.argtypes = [ptr, ptr, cint, i64, i64, ptr, i64, cint, ptr, ptr, i64, i64, cint]
        fn.restype = cint
        self.fn = fn
        run = lib.cs_q_run
        run.argtypes = [ptr, i64, ptr]
        run.restype = cint
        self.run = run
        self.simd = bool(lib.cs_q_simd())
        self.avx512 = bool(lib.cs_q_avx512())  # the activation prologue 16 lanes wide (csrc/qact.h)
        self.native_bf16 = bool(lib.cs_q_bf16())  # bf16 weights multiplied by vdpbf16ps (AVX512-BF16)


@functools.cache
def load_kernel() -> QKernel | None:
    """The kernel for this process, built on first use; None when disabled (``CHUNKSERVE_QKERNEL=0``) or it
    cannot be built."""
    if not env.qkernel_enabled():
        return None
    return bind_or_none(lambda: QKernel(build()), "block-quantised CPU kernel (dequantising per call)")


def block_linear(w: BlockWeight, b: torch.Tensor | None, dtype: torch.dtype,
                 out_dtype: torch.dtype | None = None) -> LinearFn:
    """A bound linear x: [T, K] (model `dtype`) -> y: [T, N] in `out_dtype` (default `dtype`) over `w`."""
    out_dtype = out_dtype or dtype
    kern = load_kernel() if w.q.device.type == "cpu" else None
    if kern is None or dtype not in _DTYPE_CODES or out_dtype not in _DTYPE_CODES:
        bias = None if b is None else b.to(out_dtype)

        def dequant_run(x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
            return F.linear(x.to(out_dtype), w.dequantize(out_dtype), bias)

        return dequant_run
    return BlockLinear(kern, w, b, dtype, out_dtype)


def fused_block_linear(w: BlockWeight, b: torch.Tensor | None, dtype: torch.dtype, *,
                       norm: tuple[torch.Tensor, float] | None = None, glu: bool = False) -> BlockLinear | None:
    """The kernel's linear with a prologue on its input, or None when the kernel is unavailable here.

    norm (weight [K] in `dtype`, eps): RMSNorm of the input first; glu: the input rows hold 2K values
    (gate, up) and the matmul takes silu(gate) * up. Call as ``f(x)`` or ``f(x, out)`` (out += result, in
    place), or ``f(x, rope=(cos, sin, columns))`` to rotate the first output columns (RoPE) in place. The
    prologue runs where the activations are quantised anyway, so it costs no extra pass."""
    kern = load_kernel() if w.q.device.type == "cpu" else None
    if kern is None or dtype not in _DTYPE_CODES:
        return None
    return BlockLinear(kern, w, b, dtype, dtype, norm=norm, glu=glu)


class BlockLinear:
    """The kernel's call over one weight; holds the weight, the bias and the argument struct alive."""

    __slots__ = ("addr", "args", "bias", "dtype", "fn", "in_k", "k", "kern", "n", "norm_w", "out_dtype",
                 "serial_rows", "w", "xcode")

    def __init__(self, kern: QKernel, w: BlockWeight, b: torch.Tensor | None, dtype: torch.dtype,
                 out_dtype: torch.dtype, norm: tuple[torch.Tensor, float] | None = None, glu: bool = False) -> None:
        self.n, self.k = w.shape
        self.in_k = 2 * self.k if glu else self.k  # input columns
        wtype = 0 if isinstance(w, Q4Weight) else 1 if isinstance(w, Q8Weight) else 2
        self.w = pack(w)  # the kernel's layout (the caller's Q4Weight / Q8Weight can be dropped)
        self.bias = None if b is None else b.to(out_dtype).contiguous()
        self.norm_w = None if norm is None else norm[0].to(dtype).contiguous()  # [K]
        if self.norm_w is not None and self.norm_w.shape != (self.k,):
            raise ValueError(f"norm weight of shape {tuple(self.norm_w.shape)} for a linear of input size {self.k}")
        self.args = _CsQWeight(wtype, _DTYPE_CODES[out_dtype], self.w.data_ptr(),
                               None if self.bias is None else self.bias.data_ptr(), self.n, self.k,
                               None if self.norm_w is None else self.norm_w.data_ptr(),
                               0.0 if norm is None else float(norm[1]), int(glu))
        self.addr, self.fn, self.kern = ctypes.addressof(self.args), kern.fn, kern
        self.dtype, self.out_dtype, self.xcode = dtype, out_dtype, _DTYPE_CODES[dtype]
        self.serial_rows = max(1, SERIAL_WORK // (self.n * self.k))  # calls of fewer rows run on one thread

    def threads_for(self, rows: int) -> int:
        """Threads a call over ``rows`` activation rows runs on."""
        return 1 if rows < self.serial_rows else torch.get_num_threads()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        # x: [T, K] ([T, 2K] with glu) -> y: [T, N], or out: [T, N] += that, returned.
        # rope (cos [T, D], signed sin [T, D], columns): the first `columns` outputs (heads of D) rotated in place
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.in_k:
            raise ValueError(f"expected input [T, {self.in_k}], got {tuple(x.shape)}")
        if out is None:
            y, acc = torch.empty(t, self.n, dtype=self.out_dtype), 0
        elif out.shape != (t, self.n) or out.dtype != self.out_dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be [{t}, {self.n}] {self.out_dtype} with unit column stride")
        else:
            y, acc = out, 1
        if rope is None:
            cos_p = sin_p = None
            cols = d = 0
        else:
            cos, sin, cols = rope  # [T, D] each, contiguous, in the output dtype
            d = cos.shape[-1]
            if cos.dtype != self.out_dtype or sin.dtype != cos.dtype or cos.numel() != t * d or sin.numel() != t * d \
                    or not (cos.is_contiguous() and sin.is_contiguous()):
                raise ValueError(f"rope tables must be contiguous [{t}, D] {self.out_dtype}")
            cos_p, sin_p = cos.data_ptr(), sin.data_ptr()
        rc = self.fn(self.addr, x.data_ptr(), self.xcode, t, x.stride(0), y.data_ptr(), y.stride(0), acc,
                     cos_p, sin_p, cols, d, self.threads_for(t))
        if rc != 0:
            raise RuntimeError(f"cs_q_linear failed with code {rc} (N={self.n} K={self.k} T={t})")
        return y
