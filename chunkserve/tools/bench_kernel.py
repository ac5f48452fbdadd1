"""``chunkserve bench kernel``: the paper's self-attention microkernel table, measured in one run.

Rows n_p x n_s (b sequences of n_p tokens whose first n_s are shared), columns in µs: naive
attention and dense SDPA over K/V that is already contiguous per sequence (``[b, Hkv, n_p, D]``,
built outside the timed region: what a serving system without prefix sharing pays), paged (every
row reads all its chunks in place) and TPP over the same PrefixKVCache pool. Three ratios: TPP over
dense attention (the faster of naive and SDPA: the baseline a user would pick, and issue 11's targets);
TPP over the best method that shares nothing (those two, and the paged pass of the group's n_s = 0
row: our own in-place kernel where nothing is shared, which is what it pays without sharing at every
n_s); and TPP over paged at the same sharing (which reads the shared chunks from one pool, so it is
not a non-sharing method). TPP's roofline efficiency follows. The trees are built through ``chunkserve.workers.kvcache.PrefixKVCache`` (not timed).
Medians over repeats after warm-up; within an n_p group the configurations and methods are
interleaved in every repeat. On CUDA each call is a CUDA-graph replay and several KV sets are
rotated so L2 does not serve them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from chunkserve.kernels.api import get_decode_fn
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.tools import procs
from chunkserve.tools.bench_util import Machine, Timer, measure_machine, median_us, method_bytes, roofline_s

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FULL = [(n_p, n_s) for n_p in (1024, 2048, 4096) for n_s in (0, n_p // 2, 3 * n_p // 4, n_p)]
QUICK = [(1024, 0), (1024, 512), (1024, 768), (1024, 1024), (4096, 4096)]


def build_group(configs: list[tuple[int, int]], b: int, hkv: int, d: int, c: int, dtype: torch.dtype,
                device: torch.device, gen: torch.Generator) -> tuple[object, list[list[int]]]:
    """One PrefixKVCache holding every configuration of the group; returns it and the seq ids."""
    from chunkserve.workers.kvcache import PrefixKVCache  # the benchmark drives the real cache

    chunks = sum(-(-n_s // c) + b * -(-(n_p - n_s) // c) for n_p, n_s in configs) + 4
    cache = PrefixKVCache(1, hkv, d, c, chunks, dtype, device)
    n_max = max(n_p for n_p, _ in configs)
    base_k = torch.randn(1, n_max, hkv, d, generator=gen).to(dtype).to(device)
    base_v = torch.randn(1, n_max, hkv, d, generator=gen).to(dtype).to(device)
    ids: list[list[int]] = []
    for ci, (n_p, n_s) in enumerate(configs):
        shared = [ci * 10_000_000 + t for t in range(n_s)]
        rows = []
        for r in range(b):
            tail = [ci * 10_000_000 + 1_000_000 * (r + 1) + t for t in range(n_p - n_s)]
            rows.append(cache.add_sequence(shared + tail, base_k[:, :n_p], base_v[:, :n_p]))
        ids.append(rows)
    return cache, ids


def run_group(configs: list[tuple[int, int]], args: argparse.Namespace, timer: Timer,
              gen: torch.Generator) -> list[dict[str, float]]:
    """Time paged and TPP on every config of the group, then naive/SDPA on dense K/V of length n_p."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    b, h, hkv, d, c = args.batch, args.heads, args.kv_heads, args.head_dim, args.chunk_size
    scale = d**-0.5
    cache, ids = build_group(configs, b, hkv, d, c, dtype, device, gen)
    k_pool, v_pool = cache.k_pool[0], cache.v_pool[0]  # type: ignore[attr-defined]
    sets = [(k_pool, v_pool)] + [(k_pool.clone(), v_pool.clone()) for _ in range(args.kv_sets - 1)]
    tpp_name, paged_name = ("triton", "paged-triton") if args.backend == "triton" else ("torch", "paged-torch")
    tpp_fn, paged_fn = get_decode_fn(tpp_name), get_decode_fn(paged_name)
    work: dict[tuple[int, str], list] = {}
    info = []
    for ci, rows in enumerate(ids):
        ctx = cache.context(rows)  # type: ignore[attr-defined]
        q = torch.randn(b, h, d, generator=gen).to(dtype).to(device)
        q_sorted = q.index_select(0, ctx.order.to(device))
        outs = {}
        for name, fn in (("tpp", tpp_fn), ("paged", paged_fn)):
            ws, out = Workspace(), torch.empty_like(q)
            outs[name] = out
            work[(ci, name)] = timer.prepare(
                [functools.partial(fn, q_sorted, kp, vp, ctx, scale, out=out, workspace=ws) for kp, vp in sets])
        for fns in (work[(ci, "tpp")], work[(ci, "paged")]):
            fns[0]()
        torch.cuda.synchronize() if device.type == "cuda" else None
        diff = (outs["tpp"].float() - outs["paged"].float()).norm() / outs["paged"].float().norm()
        info.append({"runs": ctx.num_runs, "contiguous_runs": sum(r[4] for r in ctx.runs_host),
                     "tpp_vs_paged_rel_diff": float(diff)})
    samples: dict[tuple[int, str], list[float]] = {key: [] for key in work}
    for rep in range(args.warmup + args.repeats):
        for key, fns in work.items():
            t = timer.once(fns, args.inner)
            if rep >= args.warmup:
                samples[key].append(t)
    del work, sets, cache, k_pool, v_pool
    gc.collect()  # the cache holds reference cycles; free its pool before the dense tensors
    dense = time_dense(max(n_p for n_p, _ in configs), args, timer, gen)
    res = []
    for ci, (n_p, n_s) in enumerate(configs):
        res.append({"n_p": n_p, "n_s": n_s, "naive_us": dense["naive"], "sdpa_us": dense["sdpa"],
                    "paged_us": median_us(samples[(ci, "paged")]), "tpp_us": median_us(samples[(ci, "tpp")]),
                    "paged_min_us": min(samples[(ci, "paged")]) * 1e6, "tpp_min_us": min(samples[(ci, "tpp")]) * 1e6,
                    "naive_min_us": dense["naive_min"], "sdpa_min_us": dense["sdpa_min"], **info[ci]})
    return res


def time_dense(n_p: int, args: argparse.Namespace, timer: Timer, gen: torch.Generator) -> dict[str, float]:
    """Naive attention and SDPA over contiguous [b, Hkv, n_p, d] K/V (independent of n_s)."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    g = h // hkv
    scale = d**-0.5
    q = torch.randn(b, h, 1, d, generator=gen).to(dtype).to(device)  # [b, Hq, 1, D]
    q_grouped = q.view(b, hkv, g, d)  # GQA: the g query heads of a KV head as rows of one matmul
    sets = []
    for _ in range(args.kv_sets):
        k = torch.empty(b, hkv, n_p, d, dtype=dtype, device=device).uniform_(-1.0, 1.0)
        sets.append((k, torch.empty_like(k).uniform_(-1.0, 1.0)))

    def naive(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = torch.matmul(q_grouped, k.transpose(-1, -2)) * scale  # [b, Hkv, g, n_p]
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(dtype), v)

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=g > 1)

    work = {name: timer.prepare([functools.partial(f, k, v) for k, v in sets])
            for name, f in (("naive", naive), ("sdpa", sdpa))}
    samples: dict[str, list[float]] = {name: [] for name in work}
    for rep in range(args.warmup + args.repeats):
        for name, fns in work.items():
            t = timer.once(fns, args.inner)
            if rep >= args.warmup:
                samples[name].append(t)
    res = {name: median_us(s) for name, s in samples.items()}
    return res | {f"{name}_min": min(s) * 1e6 for name, s in samples.items()}


def finish_row(row: dict[str, float], args: argparse.Namespace, machine: Machine,
               unshared_paged_us: float | None = None) -> dict[str, Any]:
    """Add the speed-ups, bytes per method, TPP roofline time and efficiency. ``unshared_paged_us``: the paged
    pass over the same n_p with nothing shared (the group's n_s = 0 row), a non-sharing method; None when that
    row was not measured."""
    b, h, d = args.batch, args.heads, args.head_dim
    elem = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    by = method_bytes(int(row["n_p"]), int(row["n_s"]), b, h, args.kv_heads, d, elem)
    flops = 4.0 * b * h * row["n_p"] * d
    roof = roofline_s(by["tpp"], flops, machine) * 1e6
    dense = min(("naive", "sdpa"), key=lambda m: row[f"{m}_us"])
    unshared = {"naive": row["naive_us"], "sdpa": row["sdpa_us"]}
    if row["n_s"] == 0:
        unshared["paged"] = row["paged_us"]
    elif unshared_paged_us is not None:
        unshared["paged@0"] = unshared_paged_us
    best = min(unshared, key=lambda m: unshared[m])
    return {**row, "dense_best": dense, "speedup_vs_dense": row[f"{dense}_us"] / row["tpp_us"],
            "best_nonsharing": best, "speedup_vs_best": unshared[best] / row["tpp_us"],
            "speedup": row["paged_us"] / row["tpp_us"], "tpp_bytes": by["tpp"],
            "paged_bytes": by["paged"], "tpp_roofline_us": roof, "tpp_efficiency": roof / row["tpp_us"],
            "paged_roofline_us": roofline_s(by["paged"], flops, machine) * 1e6}


def format_table(rows: list[dict[str, float]], machine: Machine, args: argparse.Namespace) -> str:
    head = (f"{'n_p':>5} {'n_s':>5} | {'naive':>9} {'SDPA':>9} {'paged':>9} {'TPP':>9} | {'TPP/dense':>9} "
            f"{'TPP/best':>8} {'(best)':>7} {'TPP/paged':>9} | {'TPP MB':>7} {'paged MB':>8} {'roof µs':>8} "
            f"{'TPP eff':>7}")
    lines = [f"kernel microbenchmark: b={args.batch} Hq={args.heads} Hkv={args.kv_heads} d={args.head_dim} "
             f"c={args.chunk_size} dtype={args.dtype} device={args.device} backend={args.backend} "
             f"(µs, median of {args.repeats}{', process CPU time' if args.cpu_time else ''}); {cpu_model()}, "
             f"{torch.get_num_threads()} threads, "
             f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
             "TPP/dense: over the faster of naive and SDPA on contiguous K/V (issue 11's targets); TPP/best: over "
             "the fastest method that shares nothing (those, or paged at n_s = 0: paged@0); TPP/paged: over paged "
             "at the same sharing",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['n_p']:>5} {r['n_s']:>5} | {r['naive_us']:>9.0f} {r['sdpa_us']:>9.0f} {r['paged_us']:>9.0f} "
                     f"{r['tpp_us']:>9.0f} | {r['speedup_vs_dense']:>8.2f}x {r['speedup_vs_best']:>7.2f}x "
                     f"{r['best_nonsharing']:>7} "
                     f"{r['speedup']:>8.2f}x | {r['tpp_bytes'] / 1e6:>7.1f} "
                     f"{r['paged_bytes'] / 1e6:>8.1f} {r['tpp_roofline_us']:>8.0f} {r['tpp_efficiency']:>6.0%}")
    lines.append(f"machine: copy {machine.copy_bw / 1e9:.1f} GB/s (read+write), matmul "
                 f"{machine.matmul_flops / 1e9:.0f} GFLOP/s, threads={torch.get_num_threads()}, "
                 f"{_amx_note(args)}load average at the end {_loadavg()}")
    return "\n".join(lines)


def _amx_note(args: argparse.Namespace) -> str:
    """Whether this run's bf16 shared runs used AMX tiles (CPU, bf16 only)."""
    if args.device != "cpu" or args.dtype != "bf16":
        return ""
    from chunkserve.kernels.cpu_kernel import load_cpu_kernel

    kern = load_cpu_kernel()
    return f"AMX tiles: {'yes' if kern is not None and kern.amx_tiles(args.head_dim) else 'no'}, "


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    return procs.cpu_model() or platform.processor() or platform.machine()


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def plot(rows: list[dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    nps = sorted({int(r["n_p"]) for r in rows})
    fig, axes = plt.subplots(1, len(nps), figsize=(5 * len(nps), 4), squeeze=False)
    for ax, n_p in zip(axes[0], nps, strict=True):
        sel = [r for r in rows if r["n_p"] == n_p]
        xs = [r["n_s"] for r in sel]
        for key, label in (("naive_us", "naive"), ("sdpa_us", "SDPA"), ("paged_us", "paged"), ("tpp_us", "TPP")):
            ax.plot(xs, [r[key] for r in sel], marker="o", label=label)
        ax.set_title(f"n_p = {n_p}")
        ax.set_xlabel("shared tokens n_s")
        ax.set_ylabel("µs")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="chunkserve bench kernel", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced table (< 2 min)")
    p.add_argument("--cpu-time", action="store_true",
                   help="one thread, timed by process CPU time (robust on a machine shared with other jobs)")
    p.add_argument("--n-p", type=int, nargs="+", default=None, help="only these prompt lengths of the full table")
    p.add_argument("--backend", choices=["torch", "triton"], default=None, help="default: triton on cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="results", help="directory for JSON (+ PNG) of the table")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA; default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--kv-sets", type=int, default=None, help="KV copies rotated per timing (default 4 on cuda)")
    p.add_argument("--no-graphs", action="store_true", help="on cuda, launch eagerly instead of replaying CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-mib", type=int, default=256, help="buffer size of the bandwidth probe")
    p.add_argument("--matmul-n", type=int, default=2048, help="square GEMM size of the matmul-rate probe")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.backend is None:
        args.backend = "triton" if cuda else "torch"
    if args.backend == "triton" and not cuda:
        p.error("--backend triton needs --device cuda (the interpreter is far too slow to benchmark)")
    if args.dtype == "bf16" and args.backend == "triton" and not cuda:
        p.error("bf16 triton needs a GPU")
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.warmup = 1 if args.warmup is None else args.warmup
    args.kv_sets = args.kv_sets or (4 if cuda else 1)
    args.inner = 5 if cuda else 1
    return args


def main(argv: list[str]) -> int:
    """Run the table, print it, write ``<out>/kernel_<device>_<backend>_<dtype>[_quick].json`` (+ .png)."""
    args = parse(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    if args.cpu_time:
        torch.set_num_threads(1)
    timer = Timer(device, use_graphs=args.backend == "triton" and not args.no_graphs, cpu_time=args.cpu_time)
    # machine rates are measured before, between and after the groups; the best of them is kept
    # (a roofline must be a lower bound, and other processes may share this machine)
    rates = [measure_machine(device, DTYPES[args.dtype], timer, args.copy_mib, args.matmul_n)]
    configs = QUICK if args.quick else FULL
    if args.n_p:
        configs = [(n_p, n_s) for n_p in args.n_p for n_s in (0, n_p // 2, 3 * n_p // 4, n_p)]
    raw: list[dict[str, float]] = []
    for n_p in sorted({n for n, _ in configs}):
        group = [cfg for cfg in configs if cfg[0] == n_p]
        raw += run_group(group, args, timer, gen)
        print(f"  n_p={n_p}: " + ", ".join(f"n_s={r['n_s']} paged {r['paged_us']:.0f} µs TPP {r['tpp_us']:.0f} µs"
                                        for r in raw if r["n_p"] == n_p), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rates.append(measure_machine(device, DTYPES[args.dtype], timer, args.copy_mib, args.matmul_n))
    machine = Machine(copy_bw=max(m.copy_bw for m in rates), matmul_flops=max(m.matmul_flops for m in rates),
                      device=str(device))
    unshared = {r["n_p"]: r["paged_us"] for r in raw if r["n_s"] == 0}  # what paged pays with nothing shared
    rows = [finish_row(r, args, machine, unshared.get(r["n_p"])) for r in raw]
    text = format_table(rows, machine, args)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gqa = f"_kv{args.kv_heads}" if args.kv_heads != args.heads else ""
    stem = f"kernel_{args.device}_{args.backend}_{args.dtype}{gqa}{'_quick' if args.quick else ''}"
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "machine": machine.__dict__, "args": {k: v for k, v in vars(args).items()}, "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    if not args.quick and plot(rows, out / f"{stem}.png"):
        print(f"wrote {out / stem}.json and .png")
    else:
        print(f"wrote {out / stem}.json")
    return 0
