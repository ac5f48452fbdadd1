"""chunkserve: multi-tenant LLM serving with ChunkAttention (prefix-aware KV cache + TPP attention)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from chunkserve.workers.llm import LLM
    from chunkserve.workers.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import chunkserve.kernels` does not pull in the model stack.
    if name == "LLM":
        from chunkserve.workers.llm import LLM

        return LLM
    if name == "SamplingParams":
        from chunkserve.workers.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
