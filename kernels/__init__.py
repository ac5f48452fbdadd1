"""chunkserve.kernels: two-phase partition (TPP) attention over a prefix-aware chunked KV cache."""

from chunkserve.kernels.api import BACKENDS, chunk_attention, decode_attention, get_decode_fn, resolve_backend
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.prefill import prefill_attention
from chunkserve.kernels.torch_ops import Workspace

__all__ = [
    "BACKENDS",
    "ChunkContext",
    "Workspace",
    "chunk_attention",
    "decode_attention",
    "get_decode_fn",
    "prefill_attention",
    "resolve_backend",
]
