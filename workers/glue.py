"""The glue of dense (fp32/bf16) CPU decoder layers as one foreign call each (``csrc/glue.cpp``).

Between a layer's four matmuls the torch loop of `CausalLM.forward` runs about twenty small ATen ops
(RMSNorm in seven, RoPE in three, SwiGLU in two, residual adds); between large matmuls each costs tens of
microseconds, because its code and data have left the cache: ~0.7 ms per SmolLM2 layer at 32 rows on a
2-core EPYC, a tenth of the step. `glued_layers` runs the same layer with four calls of its own between
the matmuls: residual add + RMSNorm, RoPE in place on the q/k columns, SwiGLU, and the next add + norm.
Values are rounded to the model dtype where ATen rounds them, but the norm's sum of squares runs in another
order and SwiGLU uses its own exp, so results can differ from ATen's in the last bit (fp32), or by one bf16
step in a few values in a thousand (bf16; RoPE and the adds are exact). Built like the other CPU kernels
(`kernels/cpu_kernel.build_extension`); without a compiler the torch loop runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from chunkserve import env
from chunkserve.kernels.cpu_kernel import bind_or_none, build_extension

SOURCE = Path(__file__).with_name("csrc") / "glue.cpp"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Linear = Callable[[torch.Tensor], torch.Tensor]


class Glue:
    """ctypes binding of ``cs_g_add_rms_norm``, ``cs_g_rope`` and ``cs_g_silu_mul`` (rows contiguous)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.cs_g_abi_version() != 1:
            raise RuntimeError(f"{path} has an unexpected ABI version")
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm = lib.cs_g_add_rms_norm
        self._norm.argtypes = [ptr, ptr, ptr, cint, i64, i64, i64, i64, i64, ptr, ctypes.c_float, cint]
        self._rope = lib.cs_g_rope
        self._rope.argtypes = [ptr, ptr, ptr, cint, i64, i64, i64, i64, cint]
        self._silu = lib.cs_g_silu_mul
        self._silu.argtypes = [ptr, ptr, cint, i64, i64, i64, i64, cint]
        for fn in (self._norm, self._rope, self._silu):
            fn.restype = cint

    def add_rms_norm(self, h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """h: [T, H] (+= r in place when given), r: [T, H] -> RMSNorm(h) * w: [T, H] (a new tensor)."""
        n = h.shape[1]
        if w.dtype != h.dtype or w.shape != (n,) or h.stride(1) != 1 or (
                r is not None and (r.dtype != h.dtype or r.shape != h.shape or r.stride(1) != 1)):
            raise ValueError(f"add_rms_norm: h {tuple(h.shape)} {h.dtype}, w {tuple(w.shape)} {w.dtype}, r "
                             f"{None if r is None else (tuple(r.shape), r.dtype)}: rows of one dtype, unit stride")
        return self._add_rms_norm(h, r, w, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cols: int) -> None:
        """x: [T, >= cols] rotated in place over its first cols values; cos, sin: [T, 1, D] (contiguous)."""
        _check_rope(x, cos, sin)
        self._rope_(x, cos, sin, cols)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu: [T, 2I] (gate, up) -> silu(gate) * up: [T, I]."""
        if gu.shape[1] % 2 or gu.stride(1) != 1:
            raise ValueError(f"silu_mul: gu {tuple(gu.shape)} must hold (gate, up) halves in unit-stride rows")
        return self._silu_mul(gu)

    # The same calls without the argument checks, for `glued_layers`, which checks its inputs once per step
    # (the checks cost ~2-3 us a call, a quarter of a call at one row); the matmuls' outputs are contiguous rows
    # of the model dtype by construction.

    def _add_rms_norm(self, h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        t, n = h.shape
        o = torch.empty_like(h)
        rc = self._norm(h.data_ptr(), None if r is None else r.data_ptr(), o.data_ptr(), _DTYPE_CODES[h.dtype], t, n,
                        h.stride(0), n if r is None else r.stride(0), n, w.data_ptr(), eps, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"cs_g_add_rms_norm refused h {tuple(h.shape)} ({h.dtype})")
        return o

    def _rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cols: int) -> None:
        t, d = x.shape[0], cos.shape[-1]
        rc = self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), _DTYPE_CODES[x.dtype], t, x.stride(0), cols, d,
                        torch.get_num_threads())
        if rc:
            raise RuntimeError(f"cs_g_rope refused x {tuple(x.shape)}, cols {cols}, head dim {d}")

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        t, i2 = gu.shape
        o = gu.new_empty(t, i2 // 2)
        rc = self._silu(gu.data_ptr(), o.data_ptr(), _DTYPE_CODES[gu.dtype], t, i2 // 2, gu.stride(0), i2 // 2,
                        torch.get_num_threads())
        if rc:
            raise RuntimeError(f"cs_g_silu_mul refused gu {tuple(gu.shape)}")
        return o


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, d = x.shape[0], cos.shape[-1]
    if not (cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (t, 1, d) and cos.is_contiguous()
            and sin.is_contiguous() and x.stride(1) == 1):
        raise ValueError(f"rope_: x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin "
                         f"{tuple(sin.shape)} {sin.dtype}: one dtype, [T, 1, D] factors for x's T rows")


@functools.cache
def load_glue() -> Glue | None:
    """The library for this process, built on first use; None when the CPU kernels are disabled
    (``CHUNKSERVE_CPU_KERNEL=0``) or it cannot be built."""
    if not env.cpu_kernel_enabled():
        return None
    return bind_or_none(lambda: Glue(build_extension("glue", (SOURCE,))), "dense-layer glue kernel (using ATen ops)")


def glue_for(x: torch.Tensor) -> Glue | None:
    """The glue kernel when it can run the layers of a model whose tensors are like ``x``, else None."""
    return load_glue() if x.device.type == "cpu" and x.dtype in _DTYPE_CODES else None


def glued_layers(g: Glue, h: torch.Tensor, norms: Sequence[torch.Tensor], eps: float,
                 fns: Sequence[tuple[Linear, ...]], cos: torch.Tensor, sin: torch.Tensor,
                 heads: tuple[int, int, int], attn: Attention) -> torch.Tensor:
    """The decoder layers over h: [T, H] (the embedded rows, updated in place as the residual stream);
    norms: ln1, ln2 of every layer, then the final norm ([H] in h's dtype, as the model holds them); fns: each
    layer's (qkv, o, gate_up, down) matmuls; cos, sin: [T, 1, D] RoPE factors. Returns the final-normed hidden
    states [T, H]."""
    hq, hkv, d = heads
    t = h.shape[0]
    x = g.add_rms_norm(h, None, norms[0], eps)  # [T, H]; checks h and the first norm
    _check_rope(h, cos, sin)  # the factors, once for every layer (qkv rows come from a matmul: unit stride)
    for i, (f_qkv, f_o, f_gate_up, f_down) in enumerate(fns):
        qkv = f_qkv(x)  # [T, (Hq + 2 Hkv) D]
        g._rope_(qkv, cos, sin, (hq + hkv) * d)  # the q and k heads, in place
        qkv3 = qkv.view(t, hq + 2 * hkv, d)
        o = attn(i, qkv3[:, :hq], qkv3[:, hq:hq + hkv], qkv3[:, hq + hkv:])  # [T, Hq, D]
        x = g._add_rms_norm(h, f_o(o.reshape(t, hq * d)), norms[2 * i + 1], eps)  # h += o W_o^T; RMSNorm(ln2)
        y = f_down(g._silu_mul(f_gate_up(x)))  # [T, H]
        x = g._add_rms_norm(h, y, norms[2 * i + 2], eps)  # h += y; the next layer's ln1 (or the final norm)
    return x
