"""`EngineConfig`: the engine's options, torch-free.

The worker builds its `EngineCore` from it, and the served application's `AppConfig.engine` (router/app.py)
is this same class, validated by Pydantic when the app is built: a misspelt field fails `serve deploy`
at once, naming the field, and the ingress reads ``chunk_size`` and ``max_model_len`` from the very object
the workers get, so the router's hash chains and the workers' chunks always agree.
This module imports nothing heavy (no torch, no model), so the ingress process can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from chunkserve.workers.sampling import is_integer, is_real

QUANT_MODES = ("int8", "int4")  # block-quantised (Q8_0, Q4_1), see workers/quant.py
# torch-free copies (the ingress validates engine configs without torch); tests check them against
# kernels.api.BACKENDS, kernels.prefill.PREFILL_BACKENDS and workers.weights' dtype names
ATTENTION_BACKENDS = ("torch", "triton", "paged-torch", "paged-triton", "reference", "auto")
PREFILL_BACKENDS = ("torch", "triton", "auto")
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half", "auto")
_DEVICE_RE = re.compile(r"(cpu|meta|cuda(:\d+)?)")  # meta: shapes only (tests of the step's host syncs)


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. ``model``: None (embedded SmolLM2), a local HF dir, "random:<preset>" or a config."""

    model: Any = None
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None: bf16 on CUDA and on CPUs with
    # AVX512-BF16/AMX (workers/device.py), fp32 on other CPUs
    device: str = "cpu"
    chunk_size: int = 64
    share_prefix: bool = True
    attention_backend: str = "auto"  # decode: torch | triton | paged-torch | paged-triton | reference | auto
    prefill_backend: str = "auto"
    num_kv_chunks: int | None = None  # default: kv_cache_gb worth of chunks
    kv_cache_gb: float = 2.0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads (process-wide); None leaves torch's setting
    prepack_weights: bool = True  # CPU: keep a oneDNN-blocked copy of the matmul weights (faster, 2x memory)
    quantization: str | None = None  # "int8": Q8_0 linears; "int4": Q4_1 layers, Q8_0 lm_head (workers/quant.py)
    warmup: bool = True  # build/compile the kernels serving meets before the engine is ready (workers/warmup.py)
    fair_share: bool = True  # VTC fair share across tenants (workers/fairness.py); False: first come, first served
    fair_quantum: float = 2048.0  # weighted tokens a tenant may lead the least served one by while its shorter
    # prompts go first (0: strict VTC order; workers/fairness.py)
    max_pinned_fraction: float = 0.5  # cache_control pins may hold at most this share of the KV pool
    thread_nice: int = 4  # served engines (AsyncEngine): added to the engine thread's nice value (at most 19), so
    # the serving path's latency-bound threads on the node (event loops, ingress, proxies) preempt its compute
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not is_integer(self.chunk_size) or self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size!r}")
        if not is_real(self.kv_cache_gb) or not 0 < self.kv_cache_gb < float("inf"):
            raise ValueError(f"kv_cache_gb must be a finite number > 0, got {self.kv_cache_gb!r}")
        for name in ("num_kv_chunks", "max_model_len"):  # None is the default; 0 is not
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer or None, got {self.num_threads!r}")
        if not is_real(self.fair_quantum) or not 0 <= self.fair_quantum < float("inf"):
            raise ValueError(f"fair_quantum must be a finite number >= 0, got {self.fair_quantum!r}")
        if isinstance(self.thread_nice, bool) or not isinstance(self.thread_nice, int) or not 0 <= self.thread_nice <= 19:
            raise ValueError(f"thread_nice must be an integer in [0, 19], got {self.thread_nice!r}")
        if self.quantization is not None and self.quantization not in QUANT_MODES:
            raise ValueError(f"quantization must be one of {QUANT_MODES} or None, got {self.quantization!r}")
        self._check_choices()

    def _check_choices(self) -> None:
        """The named choices, at load rather than in a worker replica or at the first request."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend must be one of {PREFILL_BACKENDS}, got {self.prefill_backend!r}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_NAMES or (
                self.dtype is not None and not isinstance(self.dtype, str) and type(self.dtype).__name__ != "dtype"):
            raise ValueError(f"dtype must be one of {DTYPE_NAMES} or None, got {self.dtype!r}")
        if isinstance(self.device, str) and not _DEVICE_RE.fullmatch(self.device) or (
                not isinstance(self.device, str) and type(self.device).__name__ != "device"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<n>' (or 'meta'), got {self.device!r}")
        if not is_real(self.max_pinned_fraction) or not 0 <= self.max_pinned_fraction < 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1), got {self.max_pinned_fraction!r}")
        if self.extra:
            raise ValueError(f"extra is not read by the engine; set the options as fields, got {self.extra!r}")
