"""What the CPU can do, read once at engine start-up: its name, its flags, and native bf16 support.

`EngineConfig.dtype=None` means bf16 on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX-BF16:
oneDNN then runs bf16 matmuls at about twice the fp32 speed) and fp32 elsewhere (on AVX2 a bf16
matmul converts every weight on the fly and is slower than fp32).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

import torch

CPUINFO = "/proc/cpuinfo"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # Linux /proc/cpuinfo names


def cpu_info(path: str = CPUINFO) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; (platform.processor(), {}) without one."""
    name, flags = "", frozenset[str]()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return name or platform.processor() or "unknown CPU", flags


def _torch_cpu_checks() -> list[Callable[[], bool]]:
    """torch's private CPU feature probes (torch.cpu._is_avx512_bf16_supported, _is_amx_tile_supported),
    those that exist in this build."""
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return [fn for fn in (getattr(torch.cpu, n, None) for n in names) if callable(fn)]


def cpu_has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16).

    flags: CPU flag names to decide from (tests); None reads /proc/cpuinfo and, where it says no or
    is missing (not Linux), asks torch's own probes.
    """
    if flags is not None:
        return bool(BF16_FLAGS & set(flags))
    if BF16_FLAGS & cpu_info()[1]:
        return True
    for check in _torch_cpu_checks():
        try:
            if check():
                return True
        except RuntimeError:
            continue
    return False


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype that `dtype=None` means: CUDA bf16 (fp16 without bf16), CPU bf16 if native else fp32."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def describe_cpu() -> str:
    """One line for benchmark headers: model name, SIMD flags that matter here, torch's capability."""
    name, flags = cpu_info()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cap = torch.backends.cpu.get_cpu_capability()
    return f"{name} [{' '.join(shown) or 'no AVX2 flag'}; torch {cap}; native bf16: {cpu_has_native_bf16()}]"
