"""Compile the Triton kernels for a GPU that is not here, and report what ptxas made of them.

``python -m chunkserve.kernels.compile_check [--quick]`` compiles every kernel at a set of
specialisations for sm_90 and sm_80 (Triton's bundled ptxas, no GPU or driver needed) and prints
one JSON object per compile: registers per thread, spill bytes, stack frame, shared memory, and
the asynchronous copies in the PTX (``cp.async`` on sm_80+, TMA ``cp.async.bulk`` on sm_90).

The constexprs, ``num_warps`` and ``num_stages`` come from the same functions the launchers call,
and the signature marks pointers and strides 16-divisible as a real launch would (a torch
allocation is 256-byte aligned; a pool's strides are multiples of D), so what is compiled here is
what runs. It must run without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``
kernels at import), hence a module run in a subprocess by the test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from chunkserve import env

if TYPE_CHECKING:
    from chunkserve.kernels.triton_common import TileConfig

KERNELS = ("phase1", "phase1_small", "phase2", "phase2_split", "reduce", "prefill", "prefill_small")
ARCHS = (90, 80)


@dataclass(frozen=True)
class Spec:
    """One specialisation: kernel, K/V dtype ("fp16"/"bf16"), head dim, chunk size, GQA group, arch."""

    kernel: str
    dtype: str
    d: int
    c: int
    g: int
    arch: int


@dataclass(frozen=True)
class Report:
    spec: Spec
    num_warps: int
    num_stages: int
    regs: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared: int  # bytes of shared memory (static + Triton's allocation)
    cp_async: int  # cp.async (LDGSTS) instructions in the PTX
    tma: int  # cp.async.bulk (TMA) instructions in the PTX


def default_specs(quick: bool = False) -> list[Spec]:
    """Every kernel at four shapes that cover each dtype, head dim, chunk size and arch at least once.

    The full cross product (7 kernels x 2 dtypes x 3 head dims x 2 chunk sizes x 2 archs) takes
    most of an hour of ptxas on a small CPU; these four take about two minutes. The fourth
    (fp16, D=256, sm_80) is the one whose phase 1 and prefill spilled before the tiles were chosen.
    """
    shapes = [("bf16", 128, 64, 4, 90), ("fp16", 64, 16, 4, 80), ("bf16", 256, 16, 2, 90),
              ("fp16", 256, 64, 2, 80)]
    if quick:
        shapes = shapes[:1]
    return [Spec(k, *s) for s in shapes for k in KERNELS]


def tile_config(spec: Spec) -> TileConfig:
    """The tile choice the launcher makes for this kernel and shape."""
    import torch

    from chunkserve.kernels.triton_common import decode_config, rows_config

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    if spec.kernel.startswith(("prefill", "phase1")):  # _small: a decode-sized group; else a long one
        return rows_config(spec.d, 16 if spec.kernel.endswith("_small") else 1024, dtype)
    return decode_config(spec.d, spec.g, dtype)


def _signature(fn: object, consts: dict[str, object], dtype: str) -> tuple[dict[str, str], dict]:
    """Triton types per argument and the 16-divisibility attributes a real launch would carry."""
    from triton.backends.compiler import BaseBackend

    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    div16 = BaseBackend.parse_attr("D")
    for i, name in enumerate(fn.arg_names):  # type: ignore[attr-defined]
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out"):
            sig[name], attrs[(i,)] = "*" + dtype, div16
        elif name in ("PO", "PM", "PL", "SO", "SM", "SL"):
            sig[name], attrs[(i,)] = "*fp32", div16
        elif name == "scale":
            sig[name] = "fp32"
        elif name.startswith("stride"):  # [.., Hq, D] and [Hkv, N, c, D] strides: multiples of D >= 16
            sig[name], attrs[(i,)] = "i32", div16
        elif name in ("n_split", "num_partials", "width", "kv_split", "lo", "hi"):
            sig[name] = "i32"
        else:  # int32 index arrays
            sig[name], attrs[(i,)] = "*i32", div16
    return sig, attrs


def _kernel_and_config(spec: Spec) -> tuple[Any, dict[str, Any], dict[str, int]]:
    """The jit function, its constexprs and launch options as the launcher picks them."""
    from chunkserve.kernels import prefill_triton as pf
    from chunkserve.kernels import tpp_triton as tt

    hq = 32 if spec.g <= 4 else 8 * spec.g
    cfg = tile_config(spec)
    common = dict(HEAD_D=spec.d, CHUNK=spec.c, NATIVE=True, SPLIT_P=spec.dtype == "bf16", **cfg.constexprs())
    if spec.kernel.startswith("prefill"):
        return pf._prefill_kernel, dict(G=spec.g, BLOCK_M=cfg.block_m, BLOCK_W=64, **common), cfg.options()
    if spec.kernel.startswith("phase1"):
        return tt._tpp_phase1, dict(HQ=hq, G=spec.g, BLOCK_M=cfg.block_m, **common), cfg.options()
    if spec.kernel == "reduce":
        consts = dict(HQ=hq, G=spec.g, HEAD_D=spec.d, BLOCK_G=cfg.block_m, BLOCK_D=cfg.block_d, HAS_RUNS=True)
        return tt._tpp_reduce, consts, {"num_warps": 4, "num_stages": 3}  # as launched (the defaults)
    consts = dict(HQ=hq, G=spec.g, BLOCK_G=cfg.block_m, HAS_RUNS=spec.kernel == "phase2",
                  SPLIT_KV=spec.kernel == "phase2_split", **common)
    return tt._tpp_phase2, consts, cfg.options()


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_spec(spec: Spec) -> Report:
    """Compile one specialisation with Triton (ptxas log captured) and summarise it."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn, consts, options = _kernel_and_config(spec)
    sig, attrs = _signature(fn, consts, spec.dtype)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=GPUTarget("cuda", spec.arch, 32), options=options)
    text = log.getvalue()
    used, spill = _PTXAS_USED.search(text), _PTXAS_SPILL.search(text)
    if used is None or spill is None:
        raise RuntimeError(f"no ptxas log for {spec} (was the compile served from a warm Triton cache?)\n{text}")
    ptx = kernel.asm["ptx"]
    return Report(spec, options["num_warps"], options["num_stages"], int(used.group(1)), int(spill.group(2)), int(spill.group(3)),
                  int(spill.group(1)), int(kernel.metadata.shared),
                  len(re.findall(r"cp\.async\.c[ag]\.shared", ptx)), len(re.findall(r"cp\.async\.bulk", ptx)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--kernel", choices=KERNELS, action="append", help="only these kernels")
    args = parser.parse_args(argv)
    if env.triton_interpret():
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels at import", file=sys.stderr)
        return 2
    import tempfile

    from triton import knobs

    # a fresh cache so that every compile runs ptxas (whose log carries the register/spill counts)
    with tempfile.TemporaryDirectory() as cache:
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        done: dict[tuple, Report] = {}  # identical specialisations (a small kernel at D=256 is the
        # same compile as the large one) would be served from Triton's cache without a ptxas log
        for spec in default_specs(args.quick):
            if args.kernel and spec.kernel not in args.kernel:
                continue
            fn, consts, options = _kernel_and_config(spec)
            key = (fn.__name__, spec.dtype, spec.arch, tuple(sorted(consts.items())), tuple(sorted(options.items())))
            if key not in done:
                done[key] = compile_spec(spec)
            print(json.dumps(asdict(replace(done[key], spec=spec))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
