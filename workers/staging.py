"""Host-to-device staging: a step's integer metadata built in host memory, moved in one copy.

Everything the forward needs that the host already knows (token ids, positions, K/V slots, the
rows that sample, prefill tables, the decode `ChunkContext`, the sampler's per-row knobs) is built
as numpy arrays, packed into one byte buffer and copied to the device with a single
``non_blocking`` copy from pinned memory; the device tensors are views of the copy. Nothing here
reads a device tensor back, so the step never waits for the GPU before its sampled ids.

On the CPU there is nothing to move: the tensors are ``torch.from_numpy`` views of the arrays.

Every section starts on a ``ALIGN``-byte boundary: Triton specialises a kernel on the 16-byte
alignment of its pointer arguments, so a view at a varying offset would compile a new variant.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes; Triton's pointer-alignment specialisation


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Staging:
    """Collects host arrays (``add``) and hands back device tensors of them (``flush``), in one copy.

    ``reuse``: keep one host buffer (pinned on CUDA) and one device buffer across flushes. Safe for the
    engine's step: a step's kernels are queued before the next step's copy on the same stream, and the
    host buffer is rewritten only after the previous copy has completed (an event per copy). Callers
    that keep the tensors beyond the next flush pass ``reuse=False``.
    """

    def __init__(self, device: str | torch.device, reuse: bool = True) -> None:
        self.device = torch.device(device)
        self.reuse = reuse
        self._items: list[np.ndarray] = []
        self._host: torch.Tensor | None = None  # [capacity] uint8, pinned on CUDA
        self._dev: torch.Tensor | None = None  # [capacity] uint8 on the device
        self._event: torch.cuda.Event | None = None  # the last copy out of the host buffer
        self.copies = 0  # host -> device copies made (tests, benchmarks)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def add(self, array: np.ndarray | list[int], dtype: type = np.int64) -> int:
        """Queue an array; returns its index in the list ``flush`` returns."""
        a: np.ndarray = np.ascontiguousarray(array, dtype=dtype)
        self._items.append(a)
        return len(self._items) - 1

    def flush(self) -> list[torch.Tensor]:
        """Device tensors of the queued arrays (same shapes and dtypes), in ``add`` order; clears the queue."""
        items, self._items = self._items, []
        if self.on_host:
            return [torch.from_numpy(a) for a in items]
        offsets = []
        total = 0
        for a in items:
            offsets.append(total)
            total += _round_up(max(a.nbytes, 1), ALIGN)
        host, dev = self._buffers(max(total, ALIGN))
        hv = host.numpy()
        for a, off in zip(items, offsets, strict=True):
            hv[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev[:total].copy_(host[:total], non_blocking=True)
        self.copies += 1
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        out = []
        for a, off in zip(items, offsets, strict=True):
            t = dev[off:off + a.nbytes].view(torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype)
            out.append(t.view(a.shape))
        return out

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) byte buffers of at least ``nbytes``; the host one free to overwrite."""
        if self._event is not None:
            self._event.synchronize()  # the previous copy read the host buffer; normally long done
            self._event = None
        if not self.reuse or self._host is None or self._host.numel() < nbytes:
            cap = 1 << max(12, (nbytes - 1).bit_length())
            pin = self.device.type == "cuda"
            self._host = torch.empty(cap, dtype=torch.uint8, pin_memory=pin)
            self._dev = torch.empty(cap, dtype=torch.uint8, device=self.device)
        assert self._dev is not None
        return self._host, self._dev
