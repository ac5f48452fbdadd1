"""``chunkserve up --device {auto,cpu,cuda}``: the workers' device, chosen without importing torch here.

``auto`` (the default) keeps a device or GPU count the config already sets; otherwise it picks CUDA
when torch sees a GPU. The launcher stays torch-free: a machine without an NVIDIA device node is
CPU at once, and only where one exists does a short subprocess ask torch.
"""

from __future__ import annotations

import argparse
import glob
import subprocess
import sys
from typing import Any

CHOICES = ("auto", "cpu", "cuda")


def add_device_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=CHOICES, default="auto",
                    help="workers' device: cuda (one GPU per worker), cpu, or auto (CUDA when torch sees a GPU)")


def torch_sees_cuda(timeout: float = 120.0) -> bool:
    """Whether torch in this Python sees a CUDA device (asked in a subprocess; False without NVIDIA nodes)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def apply_device(choice: str | None, base: dict[str, Any], probe: Any = torch_sees_cuda) -> str:
    """Set the AppConfig fields (``base``: its kwargs) for ``choice``; returns the device the workers get."""
    engine = dict(base.get("engine") or {})
    if choice in (None, "auto"):
        if engine.get("device") or base.get("worker_num_gpus"):
            return str(engine.get("device") or "cuda")  # the config decided
        choice = "cuda" if probe() else "cpu"
    if choice not in CHOICES:
        raise ValueError(f"--device must be one of {CHOICES}, got {choice!r}")
    engine["device"] = choice
    base["engine"] = engine
    if choice == "cuda":
        base["worker_num_gpus"] = base.get("worker_num_gpus") or 1
    else:
        base["worker_num_gpus"] = 0
    return choice
