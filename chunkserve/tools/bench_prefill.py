"""``chunkserve bench prefill``: prefill over a cached prefix against dense SDPA, side by side.

A row of ``new`` tokens attends causally to ``cached + new`` keys. chunkserve reads the keys where
they lie in the chunk pool (the cached prefix in one run of chunks, the new tokens in another, as
the engine lays them out); the baseline is one ``scaled_dot_product_attention`` over K/V already
contiguous (``[1, Hkv, cached + new, D]``, built outside the timed region) with a boolean
offset-causal mask: what a system without a chunked cache pays. Medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

import torch

from chunkserve.kernels.prefill import prefill_attention
from chunkserve.tools.bench_kernel import DTYPES, cpu_model

SHAPES = [(9, 3, 64), (32, 8, 128), (32, 32, 128)]  # (Hq, Hkv, D): SmolLM2, Llama-8B-like GQA, the paper's
CASES = [(1024, 16), (1024, 64), (1024, 512), (4096, 64), (0, 1024)]  # (cached, new)


def one_case(hq: int, hkv: int, d: int, cached: int, new: int, c: int, dtype: torch.dtype, repeats: int,
             gen: torch.Generator) -> dict[str, float]:
    """Time both methods on one shape; returns medians in ms and the max abs difference."""
    length = cached + new
    p_cached = cached // c  # full chunks of the prefix; a partly filled last one goes with the new tokens
    p_new = -(-(length - p_cached * c) // c)
    n = p_cached + p_new + 3
    k_pool = torch.randn(hkv, n, c, d, generator=gen).to(dtype)
    v_pool = torch.randn(hkv, n, c, d, generator=gen).to(dtype)
    # the prefix in chunks 0.., the new tokens' chunks after a gap (allocated later, elsewhere)
    ids = list(range(p_cached)) + list(range(p_cached + 2, p_cached + 2 + p_new))
    toks = [c] * len(ids)
    toks[-1] = length - c * (len(ids) - 1)
    table = torch.tensor([ids], dtype=torch.int32)
    tokens = torch.tensor([toks], dtype=torch.int32)
    q = torch.randn(new, hq, d, generator=gen).to(dtype)
    sel = torch.tensor(ids, dtype=torch.int64)
    kd = k_pool[:, sel].reshape(hkv, -1, d)[:, :length].unsqueeze(0).contiguous()  # [1, Hkv, L, D]
    vd = v_pool[:, sel].reshape(hkv, -1, d)[:, :length].unsqueeze(0).contiguous()
    qd = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, new, D]
    mask = torch.ones(new, length, dtype=torch.bool).tril(cached)

    def ours() -> torch.Tensor:
        return prefill_attention(q, k_pool, v_pool, table, tokens, [cached], [0, new], backend="torch")

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=hq != hkv)

    diff = float((ours().float() - sdpa()[0].transpose(0, 1).float()).abs().max())
    times: dict[str, list[float]] = {"ours": [], "sdpa": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("sdpa", sdpa)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    o, s = statistics.median(times["ours"]) * 1e3, statistics.median(times["sdpa"]) * 1e3
    return {"hq": hq, "hkv": hkv, "d": d, "cached": cached, "new": new, "ours_ms": o, "sdpa_ms": s,
            "ratio": s / o, "max_abs_diff": diff}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="chunkserve bench prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's setting)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"prefill over a cached prefix, dtype={args.dtype} c={args.chunk_size}; {cpu_model()}, "
          f"{torch.get_num_threads()} threads, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC (ms, median of "
          f"{args.repeats})")
    print(f"{'Hq':>3} {'Hkv':>3} {'D':>4} {'cached':>6} {'new':>5} | {'chunkserve':>10} {'SDPA':>9} | "
          f"{'ours/SDPA speed':>15}")
    for hq, hkv, d in SHAPES:
        for cached, new in CASES:
            r = one_case(hq, hkv, d, cached, new, args.chunk_size, DTYPES[args.dtype], args.repeats, gen)
            print(f"{hq:>3} {hkv:>3} {d:>4} {cached:>6} {new:>5} | {r['ours_ms']:>10.2f} {r['sdpa_ms']:>9.2f} | "
                  f"{r['ratio']:>14.2f}x", flush=True)
    return 0
