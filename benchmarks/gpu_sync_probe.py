"""Where does an engine step synchronise the GPU? Runs the gpu_check e2e workload and, in steps 2-3,
turns torch's sync debug mode to "warn" and prints the Python stack of every synchronising call."""

from __future__ import annotations

import traceback
import warnings

import torch

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.weights import load_model


def main() -> int:
    loaded = load_model("random:llama3-8b", dtype="bfloat16", device="cuda", tokenizer=False, progress=False)
    gen = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    shared = torch.randint(0, vocab, (1024,), generator=gen).tolist()
    eng = EngineCore(EngineConfig(device="cuda", dtype="bfloat16", chunk_size=64, attention_backend="triton",
                                  prefill_backend="auto", kv_cache_gb=6, max_num_seqs=64,
                                  max_num_batched_tokens=4096, warmup=True), loaded=loaded)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=True)
    for i in range(16):
        eng.add_request(f"r{i}", shared + torch.randint(0, vocab, (64,), generator=gen).tolist(), params)
    def show(message: object, *_args: object, **_kw: object) -> None:
        print(f"-- {message}\n" + "".join(traceback.format_stack()[-8:-1]), flush=True)

    warnings.showwarning = show  # type: ignore[assignment]
    warnings.simplefilter("always")
    for step in range(4):
        print(f"== step {step}", flush=True)
        if step >= 2:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
