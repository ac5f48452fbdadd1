"""What the Triton attention kernels share: the pipelined key loop, the partial merge, tile choices.

``_attend`` walks a list of chunks as a flat sequence of *slots* (chunk ``k`` owns slots
``k*CHUNK .. k*CHUNK+CHUNK-1``; slot ``t`` of a chunk is valid when ``t < tokens[k]``) in tiles of
``BLOCK_N`` slots. A tile spans part of one chunk (CHUNK >= BLOCK_N) or several whole chunks
(CHUNK < BLOCK_N), so the tile, and what one pipeline stage holds in flight, does not depend on
the chunk size. Every K/V load is masked rather than branched around: a branch inside the loop
(``if t0 < nt``) stops Triton's software pipeliner, which is what turns the loads into
``cp.async`` copies issued ``num_stages - 1`` tiles ahead. Invalid slots (free slots of a partly
filled chunk, which may hold NaN) are never read: their loads are masked to 0 and their logits to
``-inf``.

Dots: with ``NATIVE`` (16-bit K/V on a GPU) QK^T runs on 16-bit tensor cores with fp32
accumulation, and P@V too, P rounded to the K/V dtype. fp16 keeps P to 11 significant bits (as
TF32 would), bf16 only to 8, so for bf16 (``SPLIT_P``) P is split into ``hi = bf16(P)`` and
``lo = bf16(P - hi)`` and P@V is ``hi@V + lo@V`` (16 significant bits, V never up-cast). Without
``NATIVE`` (fp32, or the CPU interpreter) both dots run in fp32 (``input_precision="ieee"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chunkserve import env


@triton.jit
def _attend(q, acc, m_i, l_i, K, V, kv_off, chunks, tokens, lo, hi, offs_d, scale, stride_kn, stride_kt,
            CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
            NATIVE: tl.constexpr, SPLIT_P: tl.constexpr, pos=None, q_pos=0, CAUSAL: tl.constexpr = False):
    """Online-softmax update of (acc [M, BLOCK_D], m_i [M], l_i [M]) with chunks ``chunks[lo:hi]``.

    ``kv_off``: int64 offset of the kv head in the pools. CAUSAL (prefill): chunk ``k``'s first
    token sits at position ``pos[k]`` and query row r at ``q_pos[r]``; later keys are masked.
    """
    for it in range(0, tl.cdiv((hi - lo) * CHUNK, BLOCK_N)):
        if CHUNK % BLOCK_N == 0:  # the tile lies in one chunk: scalar index loads
            kk = lo + (it * BLOCK_N) // CHUNK
            slot = (it * BLOCK_N) % CHUNK + tl.arange(0, BLOCK_N)
            in_range = True
            ch = tl.load(chunks + kk)
            valid = slot < tl.load(tokens + kk)
        else:  # the tile spans whole chunks (BLOCK_N a multiple of CHUNK) or a ragged mix
            u = it * BLOCK_N + tl.arange(0, BLOCK_N)
            kk = lo + u // CHUNK
            slot = u % CHUNK
            in_range = kk < hi
            ch = tl.load(chunks + kk, mask=in_range, other=0)
            valid = slot < tl.load(tokens + kk, mask=in_range, other=0)
        rows = kv_off + ch.to(tl.int64) * stride_kn + slot * stride_kt
        ptrs = rows[:, None] + offs_d[None, :]
        if BLOCK_D == HEAD_D:
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & (offs_d < HEAD_D)[None, :]
        k = tl.load(K + ptrs, mask=kv_mask, other=0.0)
        v = tl.load(V + ptrs, mask=kv_mask, other=0.0)
        if NATIVE:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        ok = valid[None, :]
        if CAUSAL:
            key_pos = tl.load(pos + kk, mask=in_range, other=0) + slot
            ok = ok & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(ok, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if NATIVE:
            p_hi = p.to(v.dtype)
            acc = tl.dot(p_hi, v, acc)
            if SPLIT_P:
                acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge(acc, m_i, l_i, po, pm, pl):
    """Fold one partial (po [M, BLOCK_D], pm [M], pl [M]) into the running (acc, m_i, l_i)."""
    m_new = tl.maximum(m_i, pm)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    beta = tl.exp(pm - m_safe)
    return acc * alpha[:, None] + po * beta[:, None], m_new, l_i * alpha + pl * beta


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options of one kernel specialisation."""

    block_m: int  # query rows per program (packed tokens x GQA heads)
    block_n: int  # key slots per tile
    block_d: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread ptxas may use (None: up to 255)

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_N": self.block_n, "BLOCK_D": self.block_d}

    def options(self) -> dict[str, int]:
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return opts | ({"maxnreg": self.maxnreg} if self.maxnreg else {})


# Why these numbers (sm_90 first, sm_80 must still compile without spills; checked by
# tests/kernels/test_triton_compile.py, which compiles every kernel at these choices):
# * Stages. The K/V addresses come from a chunk-index load inside the loop, so Triton's pipeliner
#   splits the num_stages - 1 stages of latency between the index loads and the K/V loads: 5 stages
#   give the K/V tiles 2 stages (3 buffers when an asynchronous wgmma still reads one), 3 stages
#   only 1, i.e. no copy in flight while a tile is used (measured in the TTGIR).
# * Registers. An SM has 64 K 32-bit registers. The memory-bound decode kernels are capped at 168
#   per thread (maxnreg), so three 4-warp programs fit an SM and keep 2 x 32 KB each in flight;
#   ptxas otherwise takes up to 255 for ILP. Row kernels at 64 rows hold a 64 x D fp32 accumulator:
#   <= 255 at 4 warps (two programs per SM); at D = 256 they use the 16-row tile (64 x 256 on 4
#   warps spills, 32 x 256 on 8 warps spills in prefill under a 128-register cap).
# * Tiles. K tiles of 8 K elements (16 KB in 16 bits): 128/64 key slots at D = 64/128; 16 at 256.
#   16-row programs use mma.sync (wgmma needs 64 rows); 64-row ones use wgmma on sm_90.
DECODE_MAXNREG = 168
SMALL_ROWS = 16


def _block_n(block_d: int, itemsize: int) -> int:
    """Key slots per tile of the 16-row (decode-shaped) programs: an 8 K-element K tile (16 KB in
    16 bits) up to D = 128, then 16 slots (at D = 256 a 32-slot tile makes prefill spill)."""
    if block_d >= 256:
        return 16
    return max(16, min(128, (8192 if itemsize <= 2 else 4096) // block_d))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def decode_config(d: int, g: int, dtype: torch.dtype) -> TileConfig:
    """Phase 2 and the paged baseline: one token's G query heads (padded to >= 16 rows) per program."""
    block_d = max(16, triton.next_power_of_2(d))
    stages = 5 if _itemsize(dtype) <= 2 else 3
    block_n = _block_n(block_d, _itemsize(dtype))
    return TileConfig(max(SMALL_ROWS, triton.next_power_of_2(g)), block_n, block_d, 4, stages, DECODE_MAXNREG)


def rows_config(d: int, rows: int, dtype: torch.dtype) -> TileConfig:
    """Phase 1 and prefill with ``rows`` packed query rows (tokens x GQA heads) in the largest group.

    64 rows on 4 warps (wgmma on sm_90) for more than 16 rows up to D = 128 in 16 bits; otherwise
    the decode tile: 16 rows (at D = 256, 32 rows on 8 warps spill in prefill under the 2-programs
    cap, and 64 x 256 on 4 warps spills anyway), fp32 too.
    """
    block_d = max(16, triton.next_power_of_2(d))
    if rows <= SMALL_ROWS or block_d > 128 or _itemsize(dtype) > 2:
        return decode_config(d, 1, dtype)
    return TileConfig(64, 64, block_d, 4, 5)


def interpreting() -> bool:
    return env.triton_interpret()


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict[str, bool]:
    """The NATIVE / SPLIT_P constexprs: 16-bit tensor-core dots only on a real GPU."""
    native = dtype != torch.float32 and device.type == "cuda" and not interpreting()
    return {"NATIVE": native, "SPLIT_P": native and dtype == torch.bfloat16}


def check_triton_inputs(q: torch.Tensor, k_pool_l: torch.Tensor) -> None:
    """Reject what the Triton kernels cannot run (bf16 in the interpreter, non-CUDA without it)."""
    if k_pool_l.device.type != "cuda" and not interpreting():
        raise ValueError("triton backends need a CUDA device (or TRITON_INTERPRET=1 set before import)")
    if interpreting() and q.dtype == torch.bfloat16:
        raise ValueError("bf16 triton kernels run on GPUs only (the interpreter cannot); use fp16/fp32")
    if not k_pool_l.is_contiguous():
        raise ValueError("pool layer must be contiguous [Hkv, N, c, D]")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (no split then)."""
    if device.type != "cuda" or interpreting():
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a 1-element stand-in when empty (a CUDA launch rejects the null pointer of an
    empty tensor; the kernels never read it then)."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)
