"""Tools that run beside a server rather than inside it: `chunkserve bench serve` (`bench_serve`), a serving
benchmark for any OpenAI-compatible endpoint. Torch-free: nothing here imports torch or the model."""
