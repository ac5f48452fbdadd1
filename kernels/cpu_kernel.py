"""The in-place CPU decode kernel (``csrc/decode_cpu.cpp``): built once per machine, called through ctypes.

Every row of a decode batch attends over a table of chunk ids read where they lie in the pool, so
private chunks cost what dense attention over contiguous K/V costs: no gather, no copy, no
per-position Python loop. The source is compiled with the system C++ compiler (``$CXX`` or g++,
``-O3 -march=native -fopenmp``, about 2 s) on first use, and the shared library is cached under
``$CHUNKSERVE_CACHE/ext`` (default ``~/.cache/chunkserve/ext``), keyed by the source, the compiler
and the CPU's flags, so a cache copied to another CPU model is rebuilt, never run on the wrong ISA.
Its OpenMP threads come from the runtime torch has already loaded (same soname), sized by
``torch.get_num_threads()``. Without a compiler the torch backends fall back to their gather path;
``CHUNKSERVE_CPU_KERNEL=0`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from chunkserve import env
from chunkserve.kernels.torch_ops import Workspace

log = logging.getLogger(__name__)
T = TypeVar("T")
CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_cpu.cpp", CSRC / "run_cpu.cpp")  # one library; headers: csrc/*.h
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP, MAX_CHUNK, MAX_HEAD_DIM = 32, 256, 256  # the kernel's stack tiles (see the source)
# cs_run_attention's return codes (csrc/run_cpu.cpp)
RUN_ERRORS = {
    -1: "unsupported head dim, chunk size, split count, group or scale",
    -2: "split runs without their scratch",
    -3: "unsupported KV dtype",
    -4: "accumulate without one slot",
    -5: "causal runs split into several items",
    -6: "bf16 output with accumulate, or a bf16 q with a head dim over MAX_HEAD_DIM",
}
MIN_SPLIT_TOKENS = 256  # a split of a row's keys is at least this many tokens
SERIAL_ELEMENTS = 1 << 19  # K elements (upper bound) below which one thread does the call (~2 MB fp32)


def _cache_dir() -> Path:
    return env.cache_root() / "ext"


def _cpu_signature() -> str:
    """The CPU model and ISA flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    return env.cxx_compiler()


def build_extension(stem: str, sources: Sequence[Path], force: bool = False) -> Path:
    """Compile ``sources`` (C++, plain C ABI) into one shared library for this CPU, or reuse the cached build.

    The cache key covers the sources, the headers beside them, the compiler, the flags and the CPU's
    model and ISA flags; the library lands atomically, so concurrent builders (several workers) each see
    a whole file. Raises RuntimeError when no compiler is found or the build fails.
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    texts = [p.read_text() for p in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, version, " ".join(FLAGS), _cpu_signature()])
                         .encode()).hexdigest()[:16]
    out = _cache_dir() / f"{stem}_{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *FLAGS, *map(str, sources), "-o", tmp], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"building {', '.join(s.name for s in sources)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def bind_or_none(bind: Callable[[], T], what: str) -> T | None:
    """``bind()`` (build a library with `build_extension` and bind it), or None with a warning naming ``what``
    and its fallback when there is no compiler or the build fails: every CPU kernel is optional."""
    try:
        return bind()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable: %s", what, exc)
        return None


def build(force: bool = False) -> Path:
    """Compile the decode kernels for this CPU (or reuse the cached build); returns the library's path."""
    return build_extension("decode_cpu", SOURCES, force)


class CpuDecodeKernel:
    """ctypes binding of ``cs_decode_attention``; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if lib.cs_abi_version() != 8:
            raise RuntimeError(f"{path} has an unexpected ABI version")
        fn = lib.cs_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64,
                       ptr, ptr, ptr, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        runs = lib.cs_run_attention
        runs.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, *[i64] * 8, ptr, ptr, ptr, ptr,
                         ctypes.c_int, i64, ctypes.c_float, ptr]
        runs.restype = ctypes.c_int
        self._runs = runs
        layer = lib.cs_decode_layer
        layer.argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr]
        layer.restype = ctypes.c_int
        self.decode_layer = layer  # see `cpu_layer.py`
        self.vector_width = int(lib.cs_vector_width())
        amx = lib.cs_run_amx
        amx.argtypes = [i64]
        amx.restype = ctypes.c_int
        self._amx = amx
        self.bf16_pairs = bool(lib.cs_run_bf16_pairs())  # bf16 runs multiply pairs with vdpbf16ps (csrc/run_bf16.h)

    def amx_tiles(self, head_dim: int) -> bool:
        """Whether bf16 shared runs (phase 1, and prefill over cached chunks) of this head dim run on AMX tiles
        (``csrc/run_amx.h``): an AMX-BF16 CPU, the OS's grant of tile state, head_dim % 64 == 0, and
        ``CHUNKSERVE_AMX`` not 0 (read once per process)."""
        return bool(self._amx(head_dim))

    def supports(self, q4: torch.Tensor, pool: torch.Tensor) -> bool:
        """Whether the kernel handles this call (CPU tensors, a supported dtype and shape; its dot products
        and P@V run in whole vectors, so D must be a multiple of the vector width: other head dims take the
        torch path)."""
        _b, _hkv, g, d = q4.shape
        return (pool.device.type == "cpu" and pool.dtype in DTYPE_CODES and g <= MAX_GROUP
                and pool.shape[2] <= MAX_CHUNK and d <= MAX_HEAD_DIM and d % self.vector_width == 0
                and pool.stride(3) == 1 and pool.stride(2) == d and pool.stride(1) == pool.shape[2] * d)

    def supports_runs(self, q4: torch.Tensor, pool: torch.Tensor) -> bool:
        """Whether ``run_attention`` handles this call (as ``supports``)."""
        return self.supports(q4, pool)

    def __call__(self, q4: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, table: torch.Tensor,
                 tokens: torch.Tensor, scale: float, o: torch.Tensor, lse: torch.Tensor | None,
                 ws: Workspace) -> None:
        """Attention of each row over its table of chunks, written to ``o`` (and ``lse``).

        q4: [b, Hkv, g, D] fp32; pools: [Hkv, N, c, D] (chunk and token dims contiguous); table,
        tokens: [b, P] int32 chunk ids / valid tokens (0 = skip); o: [b, Hkv, g, D] fp32 contiguous
        (normalised output); lse: [b, Hkv, g] fp32 contiguous or None (-inf for a row with no keys).
        """
        b, hkv, g, d = q4.shape
        c = k_pool_l.shape[2]
        if k_pool_l.stride() != v_pool_l.stride():
            raise ValueError("k and v pools must have the same strides")
        if not (o.is_contiguous() and o.dtype == torch.float32 and o.shape == q4.shape):
            raise ValueError("o must be a contiguous fp32 tensor shaped like q4")
        if lse is not None and not (lse.is_contiguous() and lse.dtype == torch.float32):
            raise ValueError("lse must be a contiguous fp32 tensor [b, Hkv, g]")
        table = table.to(torch.int32).contiguous()
        tokens = tokens.to(torch.int32).contiguous()
        p = table.shape[1]
        qs = ws.take("cpuk_q", (b, hkv, g, d), torch.float32, q4.device)
        torch.mul(q4, scale, out=qs)  # [b, Hkv, g, D], pre-scaled
        threads, cps, nsplit = launch_params(b, hkv, d, c, p)
        so = slse = None
        if nsplit > 1:
            so = ws.take("cpuk_so", (b, hkv, nsplit, g, d), torch.float32, q4.device)
            slse = ws.take("cpuk_slse", (b, hkv, nsplit, g), torch.float32, q4.device)
        rc = self._fn(qs.data_ptr(), k_pool_l.data_ptr(), v_pool_l.data_ptr(), k_pool_l.stride(0),
                      k_pool_l.stride(1), DTYPE_CODES[k_pool_l.dtype], table.data_ptr(), tokens.data_ptr(),
                      b, hkv, g, d, c, p, cps, nsplit, None if so is None else so.data_ptr(),
                      None if slse is None else slse.data_ptr(), o.data_ptr(),
                      None if lse is None else lse.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"cs_decode_attention failed with code {rc} (b={b} Hkv={hkv} g={g} D={d} c={c})")


def launch_params(b: int, hkv: int, d: int, c: int, p: int) -> tuple[int, int, int]:
    """(threads, chunk positions per split, splits per row) of a per-row call over a [b, p] chunk table."""
    threads = torch.get_num_threads()
    if b * hkv * p * c * d < SERIAL_ELEMENTS:  # too little work to pay for waking (or waiting on) threads
        threads = 1
    # split long rows when rows x heads alone cannot keep every thread busy (flash-decoding)
    nsplit, cps = 1, max(p, 1)
    if b * hkv < 4 * threads and p > 1:
        want = -(-4 * threads // (b * hkv))
        cps = max(-(-p // want), -(-MIN_SPLIT_TOKENS // c))
        nsplit = -(-p // cps)
    return threads, cps, nsplit


@dataclass(frozen=True)
class RunTable:
    """Phase-1 work of one step in the kernel's layout (the same for every layer of the step)."""

    rows: torch.Tensor    # [R, 2] int32: batch rows [i, j) of each run
    cptr: torch.Tensor    # [R + 1] int32: offsets into chunks / tokens
    chunks: torch.Tensor  # [sum P_r] int32 chunk ids, run after run
    tokens: torch.Tensor  # [sum P_r] int32 valid tokens per chunk
    max_rows: int         # largest j - i
    max_chunks: int       # largest P_r
    row_keys: int         # sum over runs of (j - i) * valid keys: the work, in row-key pairs
    qpos: torch.Tensor | None = None  # [R] int32, causal runs (AMX only): key index of each run's first row's token
    launch: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(runs: list[tuple[int, int]], chunk_lists: list[tuple[int, ...]],
              token_lists: list[tuple[int, ...]], qpos: list[int] | None = None) -> RunTable:
        """With ``qpos`` the runs are causal: the token of run row i + t sees the run's keys [0, qpos + t]."""
        cptr = [0]
        for cl in chunk_lists:
            cptr.append(cptr[-1] + len(cl))
        i32 = torch.int32
        return RunTable(
            rows=torch.tensor(runs, dtype=i32).view(-1, 2),
            cptr=torch.tensor(cptr, dtype=i32),
            chunks=torch.tensor([x for cl in chunk_lists for x in cl], dtype=i32),
            tokens=torch.tensor([x for tl in token_lists for x in tl], dtype=i32),
            max_rows=max((j - i for i, j in runs), default=0),
            max_chunks=max((len(cl) for cl in chunk_lists), default=0),
            row_keys=sum((j - i) * sum(tl) for (i, j), tl in zip(runs, token_lists, strict=True)),
            qpos=None if qpos is None else torch.tensor(qpos, dtype=i32))


def run_attention(kern: CpuDecodeKernel, q4: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
                  table: RunTable, scale: float, part_o: torch.Tensor, part_lse: torch.Tensor,
                  ws: Workspace, one_slot: bool = False, accumulate: bool = False) -> None:
    """TPP phase 1 on the CPU: each run's stacked queries against its chunks, read in place.

    q4: [b, Hkv, g, D] fp32 or bf16; pools: [Hkv, N, c, D]; part_o: [S >= R, b, Hkv, g, D] fp32 (or bf16 without
    ``accumulate``: a bf16 model's output, rounded as ``.to(torch.bfloat16)``) and part_lse: [S, b, Hkv, g] fp32,
    both contiguous. Slot r receives run r's partial for its rows [i, j) only; with ``one_slot`` (runs over
    disjoint rows) every run writes slot 0, so S may be 1; with ``accumulate`` (and ``one_slot``) each row's
    partial is merged by log-sum-exp into the normalised (o, lse) in slot 0.
    """
    if accumulate and not one_slot:
        raise ValueError("accumulate needs one_slot: runs over disjoint rows")
    b, hkv, g, d = q4.shape
    c = k_pool_l.shape[2]
    n_runs = table.rows.shape[0]
    out_bf16 = part_o.dtype == torch.bfloat16 and not accumulate
    if not (part_o.is_contiguous() and part_lse.is_contiguous() and part_o.shape[0] >= (1 if one_slot else n_runs)
            and part_o.shape[1:] == q4.shape and part_lse.shape == (part_o.shape[0], *q4.shape[:3])
            and (part_o.dtype == torch.float32 or out_bf16) and part_lse.dtype == torch.float32):
        raise ValueError("part_o / part_lse must be contiguous fp32 [S >= runs, b, Hkv, g, D] / [S, b, Hkv, g] "
                         "(part_o may be bf16 without accumulate)")
    # the kernel reads a contiguous fp32 or bf16 q as it lies, scaling it as it reads it (kRawQ; kQBf16); other q
    # are converted exactly, then scaled in fp32
    raw = q4.is_contiguous() and (q4.dtype == torch.float32 or (q4.dtype == torch.bfloat16 and d <= MAX_HEAD_DIM))
    qs = q4 if raw else ws.take("cpuk_q", (b, hkv, g, d), torch.float32, q4.device).copy_(q4).mul_(scale)
    threads, nsplit, mmax = run_launch_params(table, hkv, g, d, c)
    so = slse = None
    if nsplit > 1:
        so = ws.take("cpuk_run_so", (n_runs, hkv, nsplit, mmax, d), torch.float32, q4.device)
        slse = ws.take("cpuk_run_slse", (n_runs, hkv, nsplit, mmax), torch.float32, q4.device)
    rc = kern._runs(qs.data_ptr(), k_pool_l.data_ptr(), v_pool_l.data_ptr(), k_pool_l.stride(0), k_pool_l.stride(1),
                    DTYPE_CODES[k_pool_l.dtype], table.rows.data_ptr(), table.cptr.data_ptr(),
                    table.chunks.data_ptr(), table.tokens.data_ptr(), n_runs, b, hkv, g, d, c, nsplit, mmax,
                    None if so is None else so.data_ptr(), None if slse is None else slse.data_ptr(),
                    part_o.data_ptr(), part_lse.data_ptr(), threads,
                    int(one_slot) | 2 * int(accumulate) | 4 * int(raw) | 8 * int(qs.dtype == torch.bfloat16)
                    | 16 * int(out_bf16),
                    scale, None if table.qpos is None else table.qpos.data_ptr())
    if rc != 0:
        why = RUN_ERRORS.get(rc, "unknown code")
        raise RuntimeError(f"cs_run_attention failed with code {rc}: {why} (runs={n_runs} Hkv={hkv} g={g} D={d} c={c})")


def run_launch_params(table: RunTable, hkv: int, g: int, d: int, c: int) -> tuple[int, int, int]:
    """(threads, splits per run, largest stacked rows) of a phase-1 call over ``table`` (memoised on it)."""
    threads = torch.get_num_threads()
    key = (hkv, g, d, c, threads)
    got = table.launch.get(key)
    if got is None:
        got = table.launch[key] = _launch_params(table, hkv, d, c, threads)
    return got[0], got[1], table.max_rows * g


def _launch_params(table: RunTable, hkv: int, d: int, c: int, threads: int) -> tuple[int, int]:
    n_runs = table.rows.shape[0]
    if table.row_keys * hkv * d < SERIAL_ELEMENTS:
        return 1, 1
    if n_runs * hkv >= 4 * threads or table.max_chunks <= 1 or table.qpos is not None:  # causal runs: no splits
        return threads, 1
    # split long runs when runs x heads alone cannot keep every thread busy: the fewest splits whose items,
    # handed out in order to the first free thread (the kernel's dynamic schedule), finish soonest
    cap = max(1, min(-(-4 * threads // (n_runs * hkv)), table.max_chunks // max(1, -(-MIN_SPLIT_TOKENS // c))))
    rows = (table.rows[:, 1] - table.rows[:, 0]).tolist()
    cptr, tokens = table.cptr.tolist(), table.tokens.tolist()
    best, best_t = 1, float("inf")
    for ns in range(1, cap + 1):
        free = [0] * threads
        for r, m in enumerate(rows):
            toks = tokens[cptr[r]:cptr[r + 1]]
            cps = -(-len(toks) // ns)
            parts = [m * sum(toks[k:k + cps]) for k in range(0, len(toks), cps)]
            for _h in range(hkv):
                for w in parts:
                    i = free.index(min(free))
                    free[i] += w
        t = max(free)
        if t < 0.97 * best_t:  # a split must gain a few percent to pay for its merge
            best, best_t = ns, t
    return threads, best


@functools.cache
def load_cpu_kernel() -> CpuDecodeKernel | None:
    """The kernel for this process, built on first use; None when disabled or it cannot be built."""
    if not env.cpu_kernel_enabled():
        return None
    return bind_or_none(lambda: CpuDecodeKernel(build()), "in-place CPU decode kernel (using the gather path)")


def inplace_kernel(q4: torch.Tensor, pool: torch.Tensor, inplace: bool | None) -> CpuDecodeKernel | None:
    """The kernel a torch backend should use for this call, or None for its gather path.

    inplace: True requires the kernel (RuntimeError if it cannot serve the call), False refuses it,
    None uses it when it is available and supports the shapes.
    """
    if inplace is False or pool.device.type != "cpu":
        if inplace:
            raise RuntimeError("the in-place CPU kernel runs on CPU tensors only")
        return None
    kern = load_cpu_kernel()
    if kern is not None and kern.supports(q4, pool):
        return kern
    if inplace:
        raise RuntimeError("the in-place CPU kernel is unavailable or does not support these shapes")
    return None
