"""Where a decode step's time goes, at batch 1 / 8 / 32, and offline single-stream tok/s.

    .venv/bin/python benchmarks/bench_step.py                    # fp32, 2 threads, wall clock
    .venv/bin/python benchmarks/bench_step.py --threads 1 --clock thread --dtype bfloat16
    .venv/bin/python benchmarks/bench_step.py --quantization int8 --profile

Per batch size: b requests with short distinct prompts are prefilled, then every timed step decodes
all b rows. Timers wrap the engine's hook points (a few hundred calls per step, ~0.3 us each):
scheduler.schedule, model.forward, the bound matmuls of the layers, the per-layer `StepAttention`
call and its attention kernels (`_prefill`/`_decode`), model.compute_logits, sampler.sample.

Categories, ms per step: matmul (the layers' linears), lm_head, attn_kernel (with the fused CPU
decode layer, `kernels/cpu_layer.py`, its one call, K/V writes included), program (block-quantised
models, and bf16 ones with AVX512-BF16 at up to 8 rows: every layer of a decode step in one call,
`workers/step_program.py`: the layers' matmuls, attention, norms and residual adds; `--no-program` times
those calls one by one from Python, or for bf16 runs the oneDNN layers), kv_write+glue
(`StepAttention` minus the kernels: K/V scatter into the pool, dispatch), layer_other (embedding,
norms, RoPE, residual adds, SwiGLU, the Python of the layer loop), schedule, sample, rest (runner
glue, detokenise, bookkeeping). "overhead %" = everything but matmul, lm_head, attn_kernel and program, as a
share of the step. `--clock thread` times with the thread's CPU clock: with one intra-op thread this
is the step's own work, without the time the OS gives other processes (use it on a shared machine).
`--no-glue` runs a dense model's norms, RoPE and SwiGLU as ATen ops (`workers/glue.py` off). `--profile`
adds torch.profiler's top ops of batch-1 steps and the number of aten ops per step. Each batch size runs
`--rounds` timed rounds; the round with the fastest step is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from chunkserve.workers import runner as runner_mod

try:
    from chunkserve.workers import step_program
except ImportError:  # trees before the one-call decode step
    step_program = None  # type: ignore[assignment]
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams

PROMPT = "The history of the old harbour town begins with"
CATEGORIES = ("matmul", "lm_head", "attn_kernel", "program", "kv_write+glue", "layer_other", "schedule", "sample",
              "rest")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def cpu_model() -> str:
    """`model name` and the SIMD flags that matter here, from /proc/cpuinfo (works on older trees too)."""
    name, flags = "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} [{' '.join(shown) or 'no AVX2 flag'}]"


class Timers:
    """Seconds per name on one clock; `wrap` returns a timed version of a callable.

    A call made while a name in `skip_inside` is running is not counted (the lm_head's matmul is not
    a layer matmul)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.total: dict[str, float] = defaultdict(float)
        self.running: set[str] = set()
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any], skip_inside: tuple[str, ...] = ()) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or any(s in self.running for s in skip_inside):
                return fn(*args, **kwargs)
            self.running.add(name)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += self.clock() - t0
                self.running.discard(name)
        return timed


@contextlib.contextmanager
def instrumented(core: EngineCore, timers: Timers) -> Iterator[None]:
    """Patch the hook points of one engine (and the runner's attention class) for the duration."""
    cls, model = runner_mod.StepAttention, core.model
    has_decode = hasattr(cls, "_decode")  # older runners called the module-level decode_attention
    methods = ["__call__", "_prefill"] + (["_decode"] if has_decode else [])
    saved_methods = {m: getattr(cls, m) for m in methods}
    saved_mod = {} if has_decode else {"decode_attention": runner_mod.decode_attention}
    for m, fn in saved_methods.items():
        setattr(cls, m, timers.wrap("step_attention" if m == "__call__" else "attn_kernel", fn))
    for n, fn in saved_mod.items():
        setattr(runner_mod, n, timers.wrap("attn_kernel", fn))
    fused_cls = getattr(runner_mod, "FusedDecodeLayer", None)  # the one-call CPU layer (K/V writes inside)
    if fused_cls is not None:
        saved_methods_fused = fused_cls.__call__
        fused_cls.__call__ = timers.wrap("attn_kernel", saved_methods_fused)
    prog_cls = getattr(step_program, "StepProgram", None)  # every layer of a decode step in one call
    if prog_cls is not None:
        saved_prog_run = prog_cls.run
        prog_cls.run = timers.wrap("program", saved_prog_run)
    patched = {"schedule": (core.scheduler, "schedule"), "forward": (model, "forward"),
               "lm_head": (model, "compute_logits"), "sample": (core.sampler, "sample")}
    for name, (obj, attr) in patched.items():
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))
    # the layers' matmuls: bound per-layer functions (this tree) or the packed-linear method (older)
    saved_fns: dict[str, Any] = {}
    if hasattr(model, "_fns_rows"):
        for attr in ("_fns_row", "_fns_rows"):
            saved_fns[attr] = getattr(model, attr)
            setattr(model, attr, [tuple(timers.wrap("matmul", f) for f in fns) for fns in saved_fns[attr]])
    else:
        model._packed_linear = timers.wrap("matmul", model._packed_linear, skip_inside=("lm_head",))
    try:
        yield
    finally:
        for obj, attr in patched.values():
            delattr(obj, attr)  # back to the class attribute
        for attr, fns in saved_fns.items():
            setattr(model, attr, fns)
        if not saved_fns:
            del model._packed_linear
        for m, fn in saved_methods.items():
            setattr(cls, m, fn)
        for n, fn in saved_mod.items():
            setattr(runner_mod, n, fn)
        if fused_cls is not None:
            fused_cls.__call__ = saved_methods_fused
        if prog_cls is not None:
            prog_cls.run = saved_prog_run


def start_decoding(core: EngineCore, batch: int, gen_tokens: int, tag: str) -> None:
    """Queue `batch` requests with short distinct prompts and step until every one is decoding."""
    tok = core.tokenizer
    base = tok.encode(PROMPT) if tok is not None else list(range(1, 11))
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"bench-{tag}-{batch}-{i}", base + [100 + i], params)
    while any(r.prefilling for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):  # warm-up decode steps
        core.step()


def timed_round(core: EngineCore, batch: int, steps: int, clock: Callable[[], float], tag: str) -> dict[str, float]:
    """ms per decode step by category over `steps` steps of `batch` rows."""
    start_decoding(core, batch, steps + 8, tag)
    timers = Timers(clock)
    t_step = 0.0
    with instrumented(core, timers):
        timers.on = True
        for _ in range(steps):
            t0 = clock()
            core.step()
            t_step += clock() - t0
        timers.on = False
    while core.has_work():
        core.step()
    per = {k: v * 1e3 / steps for k, v in timers.total.items()}
    step = t_step * 1e3 / steps
    out = {"step": step, "matmul": per.get("matmul", 0.0), "lm_head": per.get("lm_head", 0.0),
           "attn_kernel": per.get("attn_kernel", 0.0), "program": per.get("program", 0.0),
           "kv_write+glue": per.get("step_attention", 0.0) - per.get("attn_kernel", 0.0),
           "schedule": per.get("schedule", 0.0), "sample": per.get("sample", 0.0)}
    out["layer_other"] = per.get("forward", 0.0) - per.get("step_attention", 0.0) - out["matmul"] - out["program"]
    out["rest"] = step - per.get("forward", 0.0) - out["lm_head"] - out["schedule"] - out["sample"]
    model_work = out["matmul"] + out["lm_head"] + out["attn_kernel"] + out["program"]
    out["overhead_pct"] = 100.0 * (step - model_work) / step
    return out


def profile_ops(core: EngineCore, steps: int, rows: int = 25) -> tuple[str, float, float]:
    """torch.profiler over `steps` batch-1 decode steps: (top-ops table by self CPU time, aten ops
    dispatched per step, top-level aten ops per step). Op counts do not depend on the machine's load."""
    from torch.profiler import ProfilerActivity, profile

    start_decoding(core, 1, steps + 8, "profile")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    while core.has_work():
        core.step()
    events = [e for e in prof.events() if "::" in e.name]
    top = [e for e in events if e.cpu_parent is None or "::" not in e.cpu_parent.name]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return table, len(events) / steps, len(top) / steps


def single_stream(core: EngineCore, gen_tokens: int, repeats: int) -> tuple[float, float]:
    """(end-to-end tok/s incl. prefill, decode-only tok/s) of one request, wall clock, best of `repeats`."""
    tok = core.tokenizer
    ids = tok.encode(PROMPT) if tok is not None else list(range(1, 11))
    best_e2e = best_dec = 0.0
    for r in range(repeats):
        core.add_request(f"single-{r}", ids, SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        n = len(core.step())  # prefill + first token
        t1 = time.perf_counter()
        while core.has_work():
            n += len(core.step())
        t2 = time.perf_counter()
        best_e2e = max(best_e2e, n / (t2 - t0))
        best_dec = max(best_dec, (n - 1) / (t2 - t1))
    return best_e2e, best_dec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto (the CPU's default)")
    ap.add_argument("--quantization", default=None, help="int8 (Q8_0) or int4 (Q4_1 layers, Q8_0 head)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size (the fastest is shown)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="tokens of the single-stream run")
    ap.add_argument("--repeats", type=int, default=3, help="single-stream runs (the fastest is shown)")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops at batch 1")
    ap.add_argument("--no-program", action="store_true",
                    help="run decode layers from Python (the same calls, timed apart) instead of one call per step")
    ap.add_argument("--no-glue", action="store_true",
                    help="dense layers: norms, RoPE and SwiGLU in ATen ops instead of `workers/glue.py`'s calls")
    args = ap.parse_args(argv)
    extra: dict[str, Any] = {"quantization": args.quantization} if args.quantization else {}
    cfg = EngineConfig(model=args.model, dtype=None if args.dtype == "auto" else args.dtype,
                       num_threads=args.threads, kv_cache_gb=0.5, **extra)
    core = EngineCore(cfg)
    if args.no_program:
        core.model.step_programs = False
    if args.no_glue and hasattr(core.model, "glue_layers"):
        core.model.glue_layers = False
    clock = CLOCKS[args.clock]
    load = os.getloadavg()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}); threads={torch.get_num_threads()}; "
          f"dtype={core.model.dtype}; quantization={args.quantization}; clock={args.clock}; "
          f"load average {load[0]:.2f}")
    print(f"{'batch':>5} {'step ms':>8} " + " ".join(f"{c:>13}" for c in CATEGORIES)
          + f" {'overhead %':>10} {'tok/s':>7}")
    for b in args.batches:
        rounds = [timed_round(core, b, args.steps, clock, f"r{i}") for i in range(args.rounds)]
        r = min(rounds, key=lambda x: x["step"])
        print(f"{b:>5} {r['step']:8.2f} " + " ".join(f"{r[c]:13.2f}" for c in CATEGORIES)
              + f" {r['overhead_pct']:10.1f} {1e3 * b / r['step']:7.1f}", flush=True)
    e2e, dec = single_stream(core, args.gen_tokens, args.repeats)
    print(f"single stream, {args.gen_tokens} tokens (wall clock): {e2e:.1f} tok/s end to end (prefill included), "
          f"{dec:.1f} tok/s decode; load average {os.getloadavg()[0]:.2f}")
    if args.profile:
        table, ops, top = profile_ops(core, 10)
        print(f"batch-1 decode step: {ops:.0f} aten ops dispatched, {top:.0f} of them called from Python\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
