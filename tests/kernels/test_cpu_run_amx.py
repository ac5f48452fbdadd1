"""bf16 shared runs on AMX tiles (``csrc/run_amx.h``): used where the CPU has AMX-BF16, and equal to float64
references over what its segment layout makes hard: several 1,024-key segments merged online, chunks larger
than a 64-key block, partly filled blocks next to NaN-filled slots, ragged row blocks, splits and accumulation.
On a CPU without AMX the same cases check the vdpbf16ps / fp32 path that runs instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chunkserve.kernels import cpu_kernel
from chunkserve.kernels.cpu_kernel import RunTable, run_attention
from chunkserve.kernels.testing import lse_reference, run_kv, sdpa_reference, torch_threads
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.workers.device import cpu_info

pytestmark = pytest.mark.skipif(cpu_kernel.load_cpu_kernel() is None, reason="no C++ compiler for the CPU kernel")


def _has_amx() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(cpu_info()[1])


def test_amx_tiles_serve_bf16_runs_exactly_where_the_cpu_has_them_and_head_dims_fit():
    kern = cpu_kernel.load_cpu_kernel()
    assert kern.amx_tiles(64) == kern.amx_tiles(128) == _has_amx()
    assert not kern.amx_tiles(80)  # not a multiple of the 64-column output tiles: vdpbf16ps path


def test_amx_can_be_turned_off_for_a_process():
    code = ("from chunkserve.kernels import cpu_kernel; k = cpu_kernel.load_cpu_kernel(); "
            "print(k is not None and k.amx_tiles(128))")
    env = {**os.environ, "CHUNKSERVE_AMX": "0", "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _pools(hkv: int, n: int, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled bf16 pools: a slot read before it is written poisons the result."""
    return (torch.full((hkv, n, c, d), float("nan"), dtype=torch.bfloat16),
            torch.full((hkv, n, c, d), float("nan"), dtype=torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c,tokens", [
    (64, (64,) * 19 + (37,)),           # 1,253 keys: two segments, the second partly filled
    (128, (128,) * 9 + (97,) + (5,)),   # chunks of two 64-key blocks, an odd tail, a 5-key chunk
    (256, (256,) * 4 + (1,) + (33,)),   # four blocks per chunk; a one-key chunk
])
@pytest.mark.parametrize("b,hkv,g,d", [(11, 2, 3, 128), (32, 1, 4, 64), (3, 3, 1, 128)])
def test_bf16_runs_over_several_segments_match_float64_references(check, threads, c, tokens, b, hkv, g, d):
    gen = torch.Generator().manual_seed(c + b + d)
    n = len(tokens) + 8
    k_pool, v_pool = _pools(hkv, n, c, d)
    chunks = tuple(torch.randperm(n, generator=gen)[: len(tokens)].tolist())
    for ch, nt in zip(chunks, tokens, strict=True):
        k_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(torch.bfloat16)
        v_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(torch.bfloat16)
    runs = [(0, b), (b // 2, b)]  # a nested run over the second half: its own slot
    table = RunTable.build(runs, [chunks, chunks[-3:]], [tokens, tokens[-3:]])
    q = torch.randn(b, hkv, g, d, generator=gen).to(torch.bfloat16).float()
    part_o, part_lse = torch.full((2, b, hkv, g, d), 7.0), torch.full((2, b, hkv, g), 7.0)
    with torch_threads(threads):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, d**-0.5, part_o, part_lse, Workspace())
    for r, ((i, j), cl, tl) in enumerate(zip(runs, [chunks, chunks[-3:]], [tokens, tokens[-3:]], strict=True)):
        keys, vals = run_kv(k_pool, v_pool, cl, tl)  # [Hkv, T, D]
        for h in range(hkv):
            qh = q[i:j, h].reshape(-1, d)
            ref = sdpa_reference(qh, keys[h : h + 1], vals[h : h + 1], d**-0.5)
            assert check.rel_err(part_o[r, i:j, h].reshape(-1, d), ref) < check.tol[torch.bfloat16], (r, h)
            lse = lse_reference(qh, keys[h], d**-0.5)
            assert torch.allclose(part_lse[r, i:j, h].reshape(-1).double(), lse, atol=2e-2), (r, h)
        assert (part_o[r, :i] == 7.0).all()  # rows outside the run are not written


def test_split_bf16_run_accumulated_into_held_partials_matches_the_reference(check, monkeypatch):
    """A long run on one KV head is split across threads; each split's segments merge online, the splits by
    log-sum-exp, and the result merges into the (o, lse) the rows already hold (a prefill's own-token part)."""
    monkeypatch.setattr(cpu_kernel, "SERIAL_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(5)
    b, hkv, g, d, c = 5, 1, 3, 128, 64
    tokens = (c,) * 47 + (19,)
    k_pool, v_pool = _pools(hkv, 60, c, d)
    chunks = tuple(torch.randperm(60, generator=gen)[:48].tolist())
    for ch, nt in zip(chunks, tokens, strict=True):
        k_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(torch.bfloat16)
        v_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(torch.bfloat16)
    own_k = torch.randn(hkv, 7, d, generator=gen).to(torch.bfloat16)
    own_v = torch.randn(hkv, 7, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(b, hkv, g, d, generator=gen).to(torch.bfloat16).float()
    qh = q[:, 0].reshape(-1, d)
    o = sdpa_reference(qh, own_k, own_v, d**-0.5).float().reshape(1, b, hkv, g, d).clone()
    lse = lse_reference(qh, own_k[0], d**-0.5).float().reshape(1, b, hkv, g).clone()
    table = RunTable.build([(0, b)], [chunks], [tokens])
    ws = Workspace()
    with torch_threads(2):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, d**-0.5, o, lse, ws, one_slot=True,
                      accumulate=True)
    assert "cpuk_run_so" in ws._bufs  # really split
    keys, vals = run_kv(k_pool, v_pool, chunks, tokens)
    keys, vals = torch.cat([keys, own_k], 1), torch.cat([vals, own_v], 1)
    ref = sdpa_reference(qh, keys, vals, d**-0.5)
    assert check.rel_err(o[0, :, 0].reshape(-1, d), ref) < check.tol[torch.bfloat16]
