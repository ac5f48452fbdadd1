"""How close a prompt's prefill runs to this CPU's GEMM roof: one prompt's wall time, its ops by self time
(torch.profiler), and oneDNN's packed GEMM at the model's layer shapes and one large square one.

    .venv/bin/python -P benchmarks/prefill_roof.py                 # bf16, one thread, 1,024 tokens
    .venv/bin/python -P benchmarks/prefill_roof.py --dtype float32 --tokens 2048

The layers' matmuls show up as ``mkldnn::_linear_pointwise``; the attention kernel and the glue run in
our own C++ (not ATen ops), so they are the wall time less the ops listed.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from chunkserve.workers.linear import pack_weight, packed_linear
from chunkserve.workers.llm import LLM
from chunkserve.workers.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, num_threads=args.threads, max_model_len=args.tokens + 64,
              num_kv_chunks=args.tokens // 64 + 8)
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def run(seed: int) -> float:
        ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        t = time.perf_counter()
        llm.generate([ids], sp)  # a new prompt each time: nothing cached
        return time.perf_counter() - t

    for s in range(2):
        run(s)
    print(f"prefill of {args.tokens} tokens, {args.dtype}, {args.threads} thread(s): wall s",
          [round(run(10 + s), 3) for s in range(3)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(99)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    c = llm.engine.model_config
    dt = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    shapes = [(c.hidden_size, c.q_size + 2 * c.kv_size), (c.q_size, c.hidden_size),
              (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]
    for t, k, n in [(args.tokens, k, n) for k, n in shapes] + [(2048, 2048, 2048)]:
        w, x = torch.randn(n, k).to(dt), torch.randn(t, k).to(dt)
        f = packed_linear(pack_weight(w, t), None)
        for _ in range(3):
            f(x)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            f(x)
        el = (time.perf_counter() - t0) / reps
        print(f"packed GEMM [{t}, {k}] x [{k}, {n}]: {el * 1e3:.2f} ms, {2 * t * k * n / el / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
