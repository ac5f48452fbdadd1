"""Sweep the Triton decode kernels' launch choices on one GPU, beside dense SDPA, in one run.

``python benchmarks/gpu_tune.py OUT_DIR [--quick]`` (a CUDA torch with triton; installs nothing).
For the kernel benchmark's two shapes (fp16 MHA 32/32 and bf16 GQA 32/8, b = 32, d = 128, c = 64) it
times TPP (CUDA-graph replays, 4 KV copies rotated so L2 does not serve them) while varying:

* with private chunks (n_s < n_p): the phase-2 tile (key slots, stages, warps, register cap) and the
  kv split (flash-decoding segments per row);
* with the whole prompt shared: the phase-1 split (chunk segments per run) and the phase-1 tile.

It writes ``tune.jsonl`` (one row per timing) and prints, per configuration, SDPA, the default
choice and the best variant. What it finds is applied by hand to ``triton_common`` /
``tpp_triton``'s rules and checked by ``gpu_check.sh``; nothing here changes the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch

from chunkserve.kernels import tpp_triton as tt
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.tools.bench_kernel import build_group, time_dense
from chunkserve.tools.bench_util import Timer, median_us

SHAPES = {"bf16_gqa": ("bf16", torch.bfloat16, 32, 8), "fp16_mha": ("fp16", torch.float16, 32, 32)}
PRIVATE = [(1024, 0), (4096, 0), (1024, 512)]
SHARED = [(1024, 1024), (4096, 4096), (1024, 768)]
# phase-2 tiles: (block_n, num_stages, num_warps, maxnreg)
P2_TILES = [(64, 5, 4, 168), (32, 5, 4, 168)]
KV_SPLITS = [0, 1, 2, 3]  # 0: the default rule
# phase-1 tiles over the packed rows: (block_m, block_n, num_stages, num_warps)
P1_TILES = [(64, 64, 5, 4), (64, 64, 4, 4), (64, 64, 5, 8), (128, 64, 4, 8), (128, 32, 5, 8), (64, 32, 6, 4)]
N_SPLITS = [0, 4, 6, 12]


class Patch:
    """Swap the tile rules tpp_triton calls (decode_config / rows_config) for the duration of a timing."""

    def __init__(self, p2: dict | None = None, p1: dict | None = None) -> None:
        self.p2, self.p1 = p2 or {}, p1 or {}
        self.saved = (tt.decode_config, tt.rows_config)

    def __enter__(self) -> None:
        dec, rows = self.saved
        tt.decode_config = lambda d, g, dtype: dataclasses.replace(dec(d, g, dtype), **self.p2)
        tt.rows_config = lambda d, n, dtype: dataclasses.replace(rows(d, n, dtype), **self.p1)

    def __exit__(self, *exc: object) -> None:
        tt.decode_config, tt.rows_config = self.saved


def time_variant(fns_args: list[tuple], timer: Timer, patch: Patch, kw: dict, repeats: int, inner: int) -> float:
    """Median µs of one variant: its callables captured (and compiled) under the patch."""
    with patch:
        fns = timer.prepare([functools.partial(tt.tpp_decode_triton, *a, **kw) for a in fns_args])
    timer.once(fns, inner)
    return median_us([timer.once(fns, inner) for _ in range(repeats)])


def sweep_shape(name: str, args: argparse.Namespace, out: list[dict]) -> None:
    label, dtype, hq, hkv = SHAPES[name]
    dev = torch.device("cpu" if args.smoke else "cuda")
    timer = Timer(dev)
    gen = torch.Generator().manual_seed(0)
    b, d, c = (2, 64, 16) if args.smoke else (32, 128, 64)
    configs = PRIVATE + SHARED
    if args.quick:
        configs = [(1024, 0), (1024, 1024), (4096, 4096)]
    if args.smoke:  # a CPU run under TRITON_INTERPRET=1 that only checks the script end to end
        configs = [(64, 0), (64, 64)]
    cache, ids = build_group(configs, b, hkv, d, c, dtype, dev, gen)
    k_pool, v_pool = cache.k_pool[0], cache.v_pool[0]  # type: ignore[attr-defined]
    sets = [(k_pool, v_pool)] + [(k_pool.clone(), v_pool.clone()) for _ in range(3)]
    ns = argparse.Namespace(dtype=label, device=dev.type, batch=b, heads=hq, kv_heads=hkv, head_dim=d,
                            kv_sets=4, warmup=2, repeats=args.repeats, inner=args.inner)
    sdpa = {n_p: time_dense(n_p, ns, timer, gen)["sdpa"] for n_p in sorted({n for n, _ in configs})}
    for (n_p, n_s), rows in zip(configs, ids, strict=True):
        ctx = cache.context(rows)  # type: ignore[attr-defined]
        q = torch.randn(b, hq, d, generator=gen).to(dtype).to(dev).index_select(0, ctx.order.to(dev))
        fns_args = [(q, kp, vp, ctx, d**-0.5) for kp, vp in sets]
        base = {"shape": name, "n_p": n_p, "n_s": n_s, "sdpa_us": sdpa[n_p]}
        variants: list[tuple[dict, Patch, dict]] = [({"variant": "default"}, Patch(), {})]
        if n_s < n_p:
            for bn, st, nw, reg in P2_TILES[:2] if args.smoke else P2_TILES:
                for ks in KV_SPLITS[:3] if args.smoke else KV_SPLITS:
                    v = {"p2_block_n": bn, "p2_stages": st, "p2_warps": nw, "p2_maxnreg": reg, "kv_split": ks}
                    p2 = {"block_n": bn, "num_stages": st, "num_warps": nw, "maxnreg": reg}
                    variants.append((v, Patch(p2=p2), {"kv_split": ks or None}))
        else:
            for bm, bn, st, nw in P1_TILES[:2] if args.smoke else P1_TILES:
                for sp in N_SPLITS[:3] if args.smoke else N_SPLITS:
                    v = {"p1_block_m": bm, "p1_block_n": bn, "p1_stages": st, "p1_warps": nw, "n_split": sp}
                    p1 = {"block_m": bm, "block_n": bn, "num_stages": st, "num_warps": nw}
                    variants.append((v, Patch(p1=p1), {"n_split": sp or None}))
        for v, patch, kw in variants:
            ws_args = [a for a in fns_args]
            kw = {**kw, "workspace": Workspace()}
            try:
                us = time_variant(ws_args, timer, patch, kw, args.repeats, args.inner)
            except Exception as e:  # a tile that does not fit (shared memory, registers): say so, go on
                row = {**base, **v, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            else:
                row = {**base, **v, "tpp_us": us, "vs_sdpa": sdpa[n_p] / us}
            out.append(row)
            print(json.dumps(row), flush=True)
        del fns_args
    del cache, sets, k_pool, v_pool
    gc.collect()
    torch.cuda.empty_cache()


def summary(rows: list[dict]) -> str:
    lines = ["shape      n_p   n_s |   SDPA  default   best | default/SDPA best/SDPA | best variant"]
    keys = sorted({(r["shape"], r["n_p"], r["n_s"]) for r in rows})
    for key in keys:
        sel = [r for r in rows if (r["shape"], r["n_p"], r["n_s"]) == key and "tpp_us" in r]
        default = next((r for r in sel if r.get("variant") == "default"), None)
        best = min(sel, key=lambda r: r["tpp_us"])
        dv = default["tpp_us"] if default else float("nan")
        extra = {k: v for k, v in best.items() if k not in ("shape", "n_p", "n_s", "sdpa_us", "tpp_us", "vs_sdpa")}
        lines.append(f"{key[0]:<9} {key[1]:>5} {key[2]:>5} | {best['sdpa_us']:>6.1f} {dv:>8.1f} {best['tpp_us']:>6.1f} | "
                     f"{best['sdpa_us'] / dv:>11.2f}x {best['vs_sdpa']:>8.2f}x | {extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--quick", action="store_true", help="three configurations per shape")
    p.add_argument("--shape", choices=list(SHAPES), action="append")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny fp16 run on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.repeats, args.inner = ["fp16_mha"], 1, 1
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()
    for name in args.shape or list(SHAPES):
        sweep_shape(name, args, rows)
    (args.out / "tune.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = (f"gpu_tune {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
            f"{torch.cuda.get_device_name() if not args.smoke else 'CPU (smoke)'} (torch {torch.__version__}), {time.time() - t0:.0f} s\n{summary(rows)}")
    (args.out / "tune_summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
