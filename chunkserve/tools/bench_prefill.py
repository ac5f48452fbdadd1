"""``chunkserve bench prefill``: prefill over a cached prefix against dense SDPA, side by side.

Each of ``rows`` rows has ``new`` tokens that attend causally to ``cached + new`` keys; the rows share
the cached prefix (the chats of a tenant after its system prompt). chunkserve reads the keys where they lie
in the chunk pool (the shared prefix in one run of chunks, each row's new tokens in its own, as the engine
lays them out); the baseline is one batched ``scaled_dot_product_attention`` over K/V already contiguous
per row (``[rows, Hkv, cached + new, D]``, built outside the timed region), the faster of two masks: a
boolean offset-causal one and torch's ``causal_lower_right`` bias (with nothing cached that is plain
``is_causal``, which skips the masked blocks): what a system without a chunked, shared cache pays. Both
are timed per layer: chunkserve's step tables are built once per step for every layer (as the engine does;
their cost is printed beside, per step), the baseline's mask and contiguous K/V outside the timed region.
Medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

import torch
from torch.nn.attention.bias import causal_lower_right

from chunkserve.kernels.prefill import PrefillTables, prefill_attention, prefill_step
from chunkserve.kernels.prefill_runs import causal_runs, run_kernel
from chunkserve.tools.bench_kernel import DTYPES, cpu_model

SHAPES = [(9, 3, 64), (32, 8, 128), (32, 32, 128)]  # (Hq, Hkv, D): SmolLM2, Llama-8B-like GQA, the paper's
CASES = [(1024, 16, 1), (1024, 64, 1), (1024, 512, 1), (4096, 64, 1), (0, 1024, 1),
         (1024, 16, 8), (1024, 64, 8)]  # (cached, new, rows)


def one_case(hq: int, hkv: int, d: int, cached: int, new: int, c: int, dtype: torch.dtype, repeats: int,
             gen: torch.Generator, rows: int = 1) -> dict[str, float | str]:
    """Time both methods on one shape; returns medians in ms and the max abs difference."""
    length = cached + new
    p_cached = cached // c  # full chunks of the prefix; a partly filled last one goes with the new tokens
    p_new = -(-(length - p_cached * c) // c)
    n = p_cached + 2 + rows * (p_new + 1)
    k_pool = torch.randn(hkv, n, c, d, generator=gen).to(dtype)
    v_pool = torch.randn(hkv, n, c, d, generator=gen).to(dtype)
    # the shared prefix in chunks 0.., each row's new tokens in chunks after a gap (allocated later, elsewhere)
    tables, toks = [], []
    for r in range(rows):
        first = p_cached + 2 + r * (p_new + 1)
        tables.append(list(range(p_cached)) + list(range(first, first + p_new)))
        toks.append([c] * (p_cached + p_new - 1) + [length - c * (p_cached + p_new - 1)])
    table = torch.tensor(tables, dtype=torch.int32)
    tokens = torch.tensor(toks, dtype=torch.int32)
    q = torch.randn(rows * new, hq, d, generator=gen).to(dtype)
    sel = torch.tensor(tables, dtype=torch.int64)  # [rows, P]
    kd = k_pool[:, sel].reshape(hkv, rows, -1, d)[:, :, :length].transpose(0, 1).contiguous()  # [rows, Hkv, L, D]
    vd = v_pool[:, sel].reshape(hkv, rows, -1, d)[:, :, :length].transpose(0, 1).contiguous()
    qd = q.view(rows, new, hq, d).transpose(1, 2)  # [rows, Hq, new, D]
    mask = torch.ones(new, length, dtype=torch.bool).tril(cached)
    cu = [r * new for r in range(rows + 1)]

    starts = [cached] * rows

    kern = run_kernel(q, k_pool)
    causal = kern is not None and causal_runs(kern, k_pool)

    def step_tables() -> PrefillTables:  # once per step, for every layer
        tabs = PrefillTables.from_host(table.numpy(), tokens.numpy(), starts, cu)
        tabs.cpu_plan(c, causal)
        return tabs

    tabs = step_tables()

    def ours() -> torch.Tensor:
        return prefill_step(q, k_pool, v_pool, tabs, backend="torch")

    lower_right = causal_lower_right(new, length)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=hq != hkv)

    def sdpa_lr() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=lower_right,
                                                                enable_gqa=hq != hkv)

    ref = sdpa().transpose(1, 2).reshape(rows * new, hq, d).float()
    diff = float((ours().float() - ref).abs().max())
    diff = max(diff, float((prefill_attention(q, k_pool, v_pool, table, tokens, starts, cu, backend="torch").float()
                            - ref).abs().max()))
    diff = max(diff, float((sdpa_lr().transpose(1, 2).reshape(rows * new, hq, d).float() - ref).abs().max()))
    times: dict[str, list[float]] = {"ours": [], "sdpa": [], "sdpa_lr": [], "plan": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("sdpa", sdpa), ("sdpa_lr", sdpa_lr), ("plan", step_tables)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    o, s_mask, s_lr, p = (statistics.median(times[k]) * 1e3 for k in ("ours", "sdpa", "sdpa_lr", "plan"))
    s, how = (s_mask, "mask") if s_mask <= s_lr else (s_lr, "lower-right")
    return {"hq": hq, "hkv": hkv, "d": d, "cached": cached, "new": new, "rows": rows, "ours_ms": o, "sdpa_ms": s,
            "sdpa_how": how, "plan_ms": p, "ratio": s / o, "max_abs_diff": diff}


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
          f"{args.repeats}; per layer, chunkserve's step tables built once per step: 'plan' is their cost per step)")
    print(f"{'Hq':>3} {'Hkv':>3} {'D':>4} {'cached':>6} {'new':>5} {'rows':>4} | {'chunkserve':>10} {'SDPA':>9} | "
          f"{'ours/SDPA speed':>15} | {'plan/step':>9} | SDPA's faster mask")
    for hq, hkv, d in SHAPES:
        for cached, new, rows in CASES:
            r = one_case(hq, hkv, d, cached, new, args.chunk_size, DTYPES[args.dtype], args.repeats, gen, rows)
            print(f"{hq:>3} {hkv:>3} {d:>4} {cached:>6} {new:>5} {rows:>4} | {r['ours_ms']:>10.2f} "
                  f"{r['sdpa_ms']:>9.2f} | {r['ratio']:>14.2f}x | {r['plan_ms']:>9.2f} | {r['sdpa_how']}", flush=True)
    return 0
