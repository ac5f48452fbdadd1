"""Helpers of the kernel benchmark: timers (wall clock on CPUs, CUDA graphs on GPUs), machine
rates (copy bandwidth, matmul rate) measured in the same process, and the bytes each method reads.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Fn = Callable[[], object]


@dataclass(frozen=True)
class Machine:
    """Rates measured in this run: bytes/s a large copy moves (read + write), matmul flop/s."""

    copy_bw: float
    matmul_flops: float
    device: str


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Replay:
    """A captured CUDA graph and the callable it was captured from. The graph holds raw device
    addresses, not references: ``fn`` (and the tensors it closes over) must outlive the graph, or a
    replay reads freed memory."""

    def __init__(self, graph: torch.cuda.CUDAGraph, fn: Fn) -> None:
        self.graph, self.fn = graph, fn

    def __call__(self) -> None:
        self.graph.replay()


class Timer:
    """Times callables on one device; on CUDA each is captured in a CUDA graph and replayed.

    ``fns`` is a list of equivalent callables, each over its own copy of the data (KV sets):
    a timing round replays them in turn, so on GPUs the next call's data is not in L2.
    """

    def __init__(self, device: torch.device, use_graphs: bool = True, cpu_time: bool = False) -> None:
        """cpu_time: on CPUs, time by this process's CPU time instead of the wall clock (meaningful
        with one thread only: it ignores time other processes take from a shared machine)."""
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.clock = time.process_time if cpu_time and device.type != "cuda" else time.perf_counter

    def prepare(self, fns: list[Fn]) -> list[Fn]:
        if not self.use_graphs:
            return fns
        out: list[Fn] = []
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for f in fns:  # warm up (compiles Triton kernels) outside the capture
                f()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        sync(self.device)
        for f in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                f()
            out.append(_Replay(graph, f))
        sync(self.device)
        return out

    def once(self, fns: list[Fn], inner: int = 1) -> float:
        """Seconds per call, averaged over one pass over ``fns`` repeated ``inner`` times."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                for f in fns:
                    f()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / (inner * len(fns))
        t0 = self.clock()
        for _ in range(inner):
            for f in fns:
                f()
        return (self.clock() - t0) / (inner * len(fns))


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _copy_bw(device: torch.device, timer: Timer, mib: int) -> float:
    n = (mib << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy = timer.prepare([lambda: dst.copy_(src)])
    timer.once(copy)
    return 2 * src.numel() * 4 / min(timer.once(copy) for _ in range(5))


def _matmul_rate(device: torch.device, dtype: torch.dtype, timer: Timer, m: int) -> float:
    a = torch.randn(m, m, device=device).to(dtype)
    b = torch.randn(m, m, device=device).to(dtype)
    c = torch.empty(m, m, device=device, dtype=dtype)
    mm = timer.prepare([lambda: torch.matmul(a, b, out=c)])
    timer.once(mm)
    inner = 10 if device.type == "cuda" else 1
    return 2 * m**3 / min(timer.once(mm, inner) for _ in range(5))


def measure_machine(device: torch.device, dtype: torch.dtype, timer: Timer, copy_mib: int = 256,
                    matmul_n: int = 2048) -> Machine:
    """Copy bandwidth (``copy_mib`` MiB buffers) and matmul rate (square GEMM of size ``matmul_n``
    in the compute dtype: the storage dtype on CUDA and for bf16 on a CPU with native bf16 (the CPU kernels
    multiply bf16 with vdpbf16ps or AMX tiles there), fp32 otherwise (they widen to fp32))."""
    from chunkserve.workers.device import cpu_has_native_bf16

    native = device.type == "cuda" or (dtype == torch.bfloat16 and cpu_has_native_bf16())
    mm_dtype = dtype if native else torch.float32
    return Machine(copy_bw=_copy_bw(device, timer, copy_mib),
                   matmul_flops=_matmul_rate(device, mm_dtype, timer, matmul_n), device=str(device))


def kv_bytes(tokens: int, hkv: int, d: int, elem: int) -> int:
    """Bytes of K and V for ``tokens`` tokens."""
    return 2 * tokens * hkv * d * elem


def method_bytes(n_p: int, n_s: int, b: int, hq: int, hkv: int, d: int, elem: int) -> dict[str, int]:
    """Bytes each method must read: TPP reads the shared prefix once, the others once per row."""
    qo = 2 * b * hq * d * elem
    shared_once = kv_bytes(n_s + b * (n_p - n_s), hkv, d, elem)
    per_row = kv_bytes(b * n_p, hkv, d, elem)
    return {"tpp": shared_once + qo, "paged": per_row + qo, "dense": per_row + qo}


def roofline_s(bytes_read: int, flops: float, machine: Machine) -> float:
    """Lower bound on time: the slower of moving the bytes at the measured copy bandwidth (bytes
    read + written per second by a large copy) and doing the flops at the measured matmul rate."""
    return max(bytes_read / machine.copy_bw, flops / machine.matmul_flops)


def prepack_hf_linears(model: torch.nn.Module, batch_hint: int) -> int:
    """Reorder every ``nn.Linear`` weight of a Hugging Face model into oneDNN's blocked layout once and run it
    through the packed linear chunkserve's engine uses (what ``ipex.optimize`` or a frozen ``torch.compile``
    would do), so that the HF baseline's matmuls are set up as well as ours. Returns how many were packed
    (0 where this torch cannot pack the model's dtype on its device)."""
    from chunkserve.workers.linear import onednn_packing_available, pack_weight, packed_linear

    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or not onednn_packing_available(mod.weight.dtype, mod.weight.device):
            continue
        fn = packed_linear(pack_weight(mod.weight.detach(), batch_hint), mod.bias)

        def forward(x: torch.Tensor, fn: Any = fn) -> torch.Tensor:  # x: [..., K] -> [..., N]
            return fn(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

        mod.forward = forward  # type: ignore[method-assign, assignment]
        n += 1
    return n


def make_prompts(b: int, n_p: int, n_s: int, vocab: int, seed: int) -> list[list[int]]:
    """b prompts of n_p random token ids whose first n_s are the same in all of them."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(n_s)]
    return [shared + [rng.randrange(100, vocab) for _ in range(n_p - n_s)] for _ in range(b)]
