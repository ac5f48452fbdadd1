"""The Triton kernels compiled for sm_90 and sm_80 on a machine without a GPU (Triton's bundled ptxas).

One subprocess (without TRITON_INTERPRET, which replaces the kernels at import) compiles every
kernel at a representative set of specialisations (``compile_check.default_specs``: bf16 and
fp16, head dims 64/128/256, chunk sizes 16/64, both archs) and reports ptxas's register and spill
counts and the asynchronous copies in the PTX. 55-90 s of ptxas on a loaded 2-core machine: slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chunkserve.kernels.compile_check import ARCHS, KERNELS, Spec, default_specs, tile_config

pytestmark = pytest.mark.slow

# Programs (CTAs) that fit one SM by registers: 64 K 32-bit registers, allocated per warp in
# units of 256 (8 per thread). The decode-shaped kernels (phase 2, its split, 16-row phase 1 and
# prefill) are memory-bound and must keep >= 3 programs' K/V copies in flight per SM (4 warps:
# <= 168 registers per thread); the 64-row phase 1 and prefill hold a 64 x D fp32 accumulator and
# need >= 2 (4 warps: <= 255, 8 warps: <= 128); the reduce is a few loads per row: >= 4.
MIN_PROGRAMS_PER_SM = {"phase1": 2, "prefill": 2, "phase1_small": 3, "prefill_small": 3, "phase2": 3,
                       "phase2_split": 3, "reduce": 4}
KV_KERNELS = ("phase1", "phase1_small", "phase2", "phase2_split", "prefill", "prefill_small")


@pytest.fixture(scope="module")
def reports() -> dict[Spec, dict]:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "chunkserve.kernels.compile_check"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[Spec(**r.pop("spec"))] = r
    return out


def _label(spec: Spec) -> str:
    return f"{spec.kernel} {spec.dtype} d={spec.d} c={spec.c} g={spec.g} sm_{spec.arch}"


def test_every_kernel_compiles_for_hopper_and_ampere_at_every_shape(reports):
    specs = default_specs()
    assert {s.kernel for s in specs} == set(KERNELS) and {s.arch for s in specs} == set(ARCHS)
    assert {s.dtype for s in specs} == {"bf16", "fp16"} and {s.d for s in specs} == {64, 128, 256}
    assert {s.c for s in specs} == {16, 64}
    missing = [_label(s) for s in specs if s not in reports]
    assert not missing, missing


def test_no_kernel_spills_registers(reports):
    spilled = {_label(s): (r["spill_stores"], r["spill_loads"], r["stack"]) for s, r in reports.items()
               if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not spilled, spilled


def programs_per_sm(regs: int, num_warps: int) -> int:
    return 65536 // (-(-regs // 8) * 8 * 32 * num_warps)


def test_registers_leave_room_for_the_programs_each_kernel_needs_per_sm(reports):
    assert programs_per_sm(168, 4) == 3 and programs_per_sm(169, 4) == 2 and programs_per_sm(255, 4) == 2
    low = {_label(s): (r["regs"], r["num_warps"], programs_per_sm(r["regs"], r["num_warps"]))
           for s, r in reports.items()
           if programs_per_sm(r["regs"], r["num_warps"]) < MIN_PROGRAMS_PER_SM[s.kernel]}
    assert not low, low


def test_kv_tiles_are_loaded_with_cp_async(reports):
    """At least one 16-byte cp.async per thread for every 16 bytes of the K and V tiles of one stage
    (the pipelined loop body alone; the prologue adds more), so the K/V loads themselves, not just
    the chunk-index loads, are asynchronous."""
    short = {}
    for s, r in reports.items():
        if s.kernel not in KV_KERNELS:
            continue
        cfg = tile_config(s)
        need = 2 * cfg.block_n * cfg.block_d * 2 // (32 * cfg.num_warps * 16)
        if r["cp_async"] + r["tma"] < need:
            short[_label(s)] = (r["cp_async"], r["tma"], need)
    assert not short, short
