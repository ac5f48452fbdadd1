"""chunkserve.kernels: two-phase partition (TPP) attention over a prefix-aware chunked KV cache."""

from chunkserve.kernels.api import BACKENDS, chunk_attention, decode_attention, get_decode_fn, resolve_backend
from chunkserve.kernels.context import ChunkContext

__all__ = ["BACKENDS", "ChunkContext", "chunk_attention", "decode_attention", "get_decode_fn", "resolve_backend"]
