"""The chunk pool: K/V storage for every layer, allocated once, and its free list.

Layout: ``k_pool, v_pool: [L, Hkv, N, c, D]``. A run of consecutive chunk ids of one layer,
``k_pool[l, :, a:b]``, reshapes without a copy to ``[Hkv, (b-a)*c, D]``, which is what phase 1 of
the TPP kernel reads. Allocation prefers consecutive ids so that a prompt's chunks form such runs.
Memory is never returned to the OS. On the CPU both tensors lie on 2 MiB pages where the kernel allows
(`arena.HugeBlock`): a decode step reads each row's chunks wherever they lie, and on 4 KiB pages nearly
every chunk costs a TLB miss.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from chunkserve.workers.arena import HugeBlock


class KVCacheFull(RuntimeError):
    """The pool has no free or evictable chunk left for the request; the scheduler should preempt."""


class ChunkPool:
    """K/V tensors for ``num_chunks`` chunks of ``chunk_size`` tokens and a free-id allocator."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int,
                 num_chunks: int, dtype: torch.dtype, device: str | torch.device) -> None:
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("chunk_size", chunk_size), ("num_chunks", num_chunks)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.chunk_size, self.num_chunks, self.dtype = chunk_size, num_chunks, dtype
        self.device = torch.device(device)
        shape = (num_layers, num_kv_heads, num_chunks, chunk_size, head_dim)
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            self._blocks = (HugeBlock(nbytes), HugeBlock(nbytes))
            self.k_pool, self.v_pool = (blk.view(dtype, shape) for blk in self._blocks)  # [L, Hkv, N, c, D] each
        else:
            self.k_pool = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, Hkv, N, c, D]
            self.v_pool = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, Hkv, N, c, D]
        self._free = np.ones(num_chunks, dtype=bool)
        self.num_free = num_chunks

    @property
    def bytes_per_chunk(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.chunk_size * self.head_dim * self.dtype.itemsize

    def is_free(self, chunk: int) -> bool:
        return bool(self._free[chunk])

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free chunk ids, consecutive where the free list allows; raises KVCacheFull."""
        if n <= 0:
            return []
        if n > self.num_free:
            raise KVCacheFull(f"need {n} free chunks, have {self.num_free}")
        free = self._free
        if n == 1:
            start = int(free.argmax())  # the first free id (n <= num_free: there is one)
        else:  # the first run of n consecutive free ids (a byte search, not a scan of every free id)
            start = free.tobytes().find(b"\x01" * n)
        ids = np.arange(start, start + n) if start >= 0 else np.flatnonzero(free)[:n]
        self._free[ids] = False
        self.num_free -= n
        return ids.tolist()

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        arr = np.asarray(ids, dtype=np.int64)
        if self._free[arr].any():
            raise RuntimeError(f"double free of chunks {arr[self._free[arr]].tolist()}")
        self._free[arr] = True
        self.num_free += len(ids)

    def copy_chunk(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots of chunk ``src`` into ``dst`` in every layer."""
        self.k_pool[:, :, dst, :num_tokens] = self.k_pool[:, :, src, :num_tokens]
        self.v_pool[:, :, dst, :num_tokens] = self.v_pool[:, :, src, :num_tokens]

    def write(self, layer: int | None, chunks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter K/V of ``n`` tokens into their slots.

        layer=None: k, v: [L, n, Hkv, D] (all layers); else k, v: [n, Hkv, D] for that layer.
        chunks, offsets: [n] int64 on the pool device.
        """
        if layer is None:
            self.k_pool[:, :, chunks, offsets] = k.permute(0, 2, 1, 3).to(self.dtype)
            self.v_pool[:, :, chunks, offsets] = v.permute(0, 2, 1, 3).to(self.dtype)
        else:
            self.k_pool[layer][:, chunks, offsets] = k.transpose(0, 1).to(self.dtype)
            self.v_pool[layer][:, chunks, offsets] = v.transpose(0, 1).to(self.dtype)
