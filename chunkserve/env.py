"""Every environment variable chunkserve reads, in one place (torch-free, imports nothing of ours).

Each is read when its function is called, never cached at import, so tests and launchers can set them
late. The library's modules call these functions instead of reading ``os.environ``.

    CHUNKSERVE_REDIS_URL   Redis of the prefix index, leases, stats and shared rate limits (router, ingress,
                           app builder); `chunkserve up` sets it for every Ray worker
    CHUNKSERVE_CACHE       cache root (converted embedded model, compiled kernels); default
                           $XDG_CACHE_HOME/chunkserve or ~/.cache/chunkserve
    CHUNKSERVE_CPU_KERNEL  "0" turns off the in-place C++ decode kernel (kernels/cpu_kernel.py)
    CHUNKSERVE_QKERNEL     "0" turns off the int4 block-quantised matmul kernel (workers/quant.py)
    CXX                    the C++ compiler to try first for those kernels
    TRITON_INTERPRET       "1": Triton's interpreter (set before the kernel modules are imported)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REDIS_URL = "CHUNKSERVE_REDIS_URL"
CACHE = "CHUNKSERVE_CACHE"
CPU_KERNEL = "CHUNKSERVE_CPU_KERNEL"
QKERNEL = "CHUNKSERVE_QKERNEL"
TRITON_INTERPRET = "TRITON_INTERPRET"


def redis_url() -> str | None:
    """``$CHUNKSERVE_REDIS_URL``, or None when unset or empty."""
    return os.environ.get(REDIS_URL) or None


def cache_root() -> Path:
    """``$CHUNKSERVE_CACHE``, else ``$XDG_CACHE_HOME/chunkserve``, else ``~/.cache/chunkserve``."""
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "chunkserve"


def cpu_kernel_enabled() -> bool:
    return os.environ.get(CPU_KERNEL, "1") != "0"


def qkernel_enabled() -> bool:
    return os.environ.get(QKERNEL, "1") != "0"


def triton_interpret() -> bool:
    return os.environ.get(TRITON_INTERPRET, "0") == "1"


def cxx_compiler() -> str | None:
    """The first of ``$CXX``, g++, c++, clang++ found on the PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None
