"""Block-quantised int4 (Q4_1) / int8 (Q8_0) linears: the quantisers, the CPU kernel, the model's "int4" mode."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chunkserve import env
from chunkserve.kernels.cpu_kernel import FLAGS
from chunkserve.workers.config import preset_config
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.model import CausalLM, DenseCausalAttention
from chunkserve.workers.quant import (
    SOURCE,
    B16Weight,
    BlockLinear,
    Q4Weight,
    Q8Weight,
    QKernel,
    block_linear,
    load_kernel,
)
from chunkserve.workers.sampling import SamplingParams


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]  # rows over 3 decades
    w[3] = 0.25  # a constant row: every block has max == min
    return w


def test_q4_1_dequantised_weights_are_within_half_a_step_of_each_block() -> None:
    w = _weight(24, 96, 0)
    qw = Q4Weight.quantize(w)
    assert qw.q.dtype == torch.uint8 and qw.q.shape == (24, 48) and qw.d.shape == qw.m.shape == (24, 3)
    assert qw.shape == w.shape
    err = (qw.dequantize() - w).abs().reshape(24, 3, 32).amax(-1)  # [24, 3]
    step = qw.d.float()
    # half a step, plus fp16 rounding of the minimum (relative 2^-11 of the block's values)
    bound = step / 2 + w.abs().reshape(24, 3, 32).amax(-1) * 2**-10 + 1e-7
    assert bool((err <= bound).all())
    assert bool((err > 0).any())
    assert torch.equal(qw.dequantize()[3], torch.full((96,), 0.25))


def test_requantising_dequantised_block_weights_gives_the_same_weights_back() -> None:
    # what makes "int4" reproduce the embedded GGUF's Q4_1 layers and Q8_0 embedding
    w = _weight(16, 64, 1)
    for cls in (Q4Weight, Q8Weight):
        once = cls.quantize(w).dequantize()
        assert torch.equal(cls.quantize(once).dequantize(), once), cls.__name__


def test_q8_0_dequantised_weights_are_within_one_254th_of_each_blocks_max() -> None:
    w = _weight(24, 96, 2)
    qw = Q8Weight.quantize(w)
    assert qw.q.dtype == torch.int8 and int(qw.q.abs().max()) <= 127 and qw.d.shape == (24, 3)
    blocks = w.abs().reshape(24, 3, 32).amax(-1)
    err = (qw.dequantize() - w).abs().reshape(24, 3, 32).amax(-1)
    assert bool((err <= blocks / 254 + blocks * 2**-10 + 1e-7).all())


@pytest.mark.parametrize("cls", [Q4Weight, Q8Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [128, 96])  # 96: an odd number of blocks (the kernel pairs blocks)
def test_block_linear_matches_the_dequantised_matmul_up_to_int8_activation_rounding(
        cls: type, dtype: torch.dtype, k: int) -> None:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(72, k, generator=g), torch.randn(72, generator=g)
    qw = cls.quantize(w)
    for rows in (1, 3, 70):  # 70 rows: more than one activation tile
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = block_linear(qw, b.to(dtype), dtype)(x)
        want = F.linear(x.float(), qw.dequantize(), b)
        assert got.dtype == dtype and got.shape == (rows, 72)
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel  # int8 activations per block of 32: ~0.5% measured


@pytest.mark.parametrize(("cls", "dtype", "rows"), [
    (Q4Weight, torch.float32, 9),
    (Q8Weight, torch.bfloat16, 16),  # Q8_0 with AVX512-VNNI: two groups side by side, tiles of 8 + 8 rows
    (Q8Weight, torch.float32, 29),  # tiles of 10, 10 and 9 rows
    (Q8Weight, torch.bfloat16, 61),  # from 48 rows four groups at a time, tiles of 6 and 5 rows
    (Q4Weight, torch.bfloat16, 29),  # Q4_1 wide tiles of at most 8 rows: 8, 7, 7, 7
    (B16Weight, torch.bfloat16, 11),  # bf16 weights: one narrow tile of 11 rows (8 outputs in the lanes)
    (B16Weight, torch.bfloat16, 16),  # one wide tile (16 rows in the lanes): the same bits as a row alone
    (B16Weight, torch.bfloat16, 29),  # wide tiles of 15 and 14 rows (zero lanes past their rows)
])
def test_block_linear_rows_do_not_depend_on_the_batch_or_the_thread_count(cls: type, dtype: torch.dtype,
                                                                         rows: int) -> None:
    if load_kernel() is None:
        pytest.skip("no C++ compiler: the fallback is F.linear")
    g = torch.Generator().manual_seed(4)
    qw = cls.quantize(torch.randn(512, 256, generator=g))
    fn = block_linear(qw, None, dtype, torch.float32)
    x = torch.randn(rows, 256, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(x)
        torch.set_num_threads(max(2, threads))
        many = fn(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    for i in sorted({0, 4, 7, 8, 14, rows - 1} & set(range(rows))):
        assert torch.equal(fn(x[i:i + 1])[0], one[i])


@pytest.mark.parametrize("off", [("-mno-avx512vnni",), ("-mno-avx2", "-mno-avx512f", "-mno-fma")],
                         ids=["no-vnni", "scalar"])
def test_block_linear_outputs_are_bitwise_the_same_whatever_the_isa_it_was_built_for(
        tmp_path: Path, off: tuple[str, ...]) -> None:
    # the block sums are exact integers (vpdpbusd, vpmaddubsw or a scalar loop) and the float steps after them
    # are the same, so a build without VNNI (or without any SIMD) must agree to the bit with this CPU's build
    kern, cxx = load_kernel(), env.cxx_compiler()
    if kern is None or cxx is None:
        pytest.skip("no C++ compiler: the fallback is F.linear")
    lib = tmp_path / "qmatmul_off.so"
    subprocess.run([cxx, *FLAGS, *off, str(SOURCE), "-o", str(lib)], check=True, capture_output=True, timeout=300)
    other = QKernel(lib)
    g = torch.Generator().manual_seed(9)
    for cls in (Q4Weight, Q8Weight):
        qw = cls.quantize(_weight(40, 96, 5))  # 5 row groups
        b = torch.randn(40, generator=g)
        for rows in (1, 3, 4, 9, 16, 70):  # from 4 (5) rows the wide tiles with AVX512-VNNI
            x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
            want = BlockLinear(kern, qw, b, torch.bfloat16, torch.float32)(x)
            assert torch.equal(BlockLinear(other, qw, b, torch.bfloat16, torch.float32)(x), want), (cls, rows)
            # bf16 outputs accumulated into y, a NaN and a huge bias among them (the vector stores' rounding)
            bb = b.clone()
            bb[3], bb[5] = float("nan"), 3e38
            y0 = (torch.randn(rows, 40, generator=g) * 5).to(torch.bfloat16)
            ya, yb = y0.clone(), y0.clone()
            BlockLinear(kern, qw, bb, torch.bfloat16, torch.bfloat16)(x, ya)
            BlockLinear(other, qw, bb, torch.bfloat16, torch.bfloat16)(x, yb)
            assert torch.equal(ya.view(torch.int16), yb.view(torch.int16)), (cls, rows)


def test_norm_and_swiglu_prologues_are_bitwise_the_same_on_an_avx2_build(tmp_path: Path) -> None:
    # the 16-lane prologue (AVX-512) does the 8-lane one's arithmetic lane for lane and sums the squares in its
    # order, so an AVX2-only build must give the same bits (huge, tiny and infinite inputs included; a NaN
    # quantises to -128, which the AVX2 build's vpmaddubsw pairs saturate, so NaN rows differ by design)
    kern, cxx = load_kernel(), env.cxx_compiler()
    if kern is None or cxx is None:
        pytest.skip("no C++ compiler: the fallback is F.linear")
    if not kern.avx512:
        pytest.skip("this CPU's build has no AVX-512 prologue to compare")
    lib = tmp_path / "qmatmul_avx2.so"
    subprocess.run([cxx, *FLAGS, "-mno-avx512f", str(SOURCE), "-o", str(lib)], check=True, capture_output=True,
                   timeout=300)
    other = QKernel(lib)
    g = torch.Generator().manual_seed(11)
    qw = Q8Weight.quantize(_weight(48, 96, 5))
    ln = (torch.rand(96, generator=g) + 0.5).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(13, 192, generator=g) * 4
        x[0, :8] = torch.tensor([float("inf"), 1e30, -1e30, 1e-40, -100.0, 90.0, 0.0, -0.0])
        x = x.to(dtype)
        for kw in ({"norm": (ln, 1e-5)}, {"glu": True}):
            cols = 192 if "glu" in kw else 96
            want = BlockLinear(kern, qw, None, dtype, dtype, **kw)(x[:, :cols])
            got = BlockLinear(other, qw, None, dtype, dtype, **kw)(x[:, :cols])
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (dtype, kw)


@pytest.mark.parametrize("cls", [Q8Weight, Q4Weight])
# 28: the second pair of groups has 12 real outputs (the scalar store); from 48 rows Q8_0 takes four groups at a time:
# 44 and 52 rows then leave a quad's second half with 12 outputs, and a pair (N 52: 7 groups) after the quad
@pytest.mark.parametrize(("n", "rows"), [(48, 20), (28, 20), (44, 61), (52, 61)])
def test_wide_tiles_write_bf16_outputs_with_bias_and_accumulation_as_a_row_alone_does(cls: type, n: int,
                                                                                      rows: int) -> None:
    # the wide tiles' vector store rounds, adds the bias and accumulates as the narrow tile's scalar one
    if load_kernel() is None:
        pytest.skip("no C++ compiler: the fallback is F.linear")
    g = torch.Generator().manual_seed(11)
    fn = block_linear(cls.quantize(_weight(n, 128, 12)), torch.randn(n, generator=g).to(torch.bfloat16),
                      torch.bfloat16)
    x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
    base = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    base[3, 5] = float("nan")
    got = fn(x, base.clone())
    for i in range(rows):  # bit patterns: the NaN too
        assert torch.equal(fn(x[i:i + 1], base[i:i + 1].clone())[0].view(torch.int16), got[i].view(torch.int16)), i
    assert torch.equal(fn(x)[7], fn(x[7:8])[0])
    assert bool(got[3, 5].isnan()) and int(got.isnan().sum()) == 1


def test_block_quantisation_rejects_input_sizes_that_are_not_multiples_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Weight.quantize(torch.randn(8, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Weight.quantize(torch.randn(8, 40))


def test_int4_model_has_q4_layers_a_q8_head_and_computes_its_dequantised_weights() -> None:
    cfg = preset_config("tiny")
    ref = CausalLM.random(cfg, seed=3, std=0.1)
    model = CausalLM.random(cfg, seed=3, std=0.1)
    model.quantize("int4")
    assert model.quantization == "int4" and isinstance(model.lm_head, Q8Weight)
    assert all(isinstance(w, Q4Weight) for lw in model.layers for w, _ in lw.matmuls())
    assert torch.equal(model.embed, ref.embed)  # the embedding table stays dense
    sd = model.state_dict()  # dequantised layers (the tied head is the dense embedding)
    assert sd.keys() == ref.state_dict().keys()
    assert not torch.equal(sd["model.layers.0.mlp.up_proj.weight"], ref.state_dict()["model.layers.0.mlp.up_proj.weight"])
    deq = CausalLM.from_state_dict(cfg, sd)
    ids, pos = torch.arange(5, 25), torch.arange(20)
    a = deq.compute_logits(deq.forward(ids, pos, DenseCausalAttention(cfg.num_layers)))
    b = model.compute_logits(model.forward(ids, pos, DenseCausalAttention(cfg.num_layers)))
    assert b.dtype == torch.float32 and not torch.equal(a, b)
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 0.05, rel  # only the int8 activations (and the Q8_0 head) differ
    with pytest.raises(ValueError, match="already"):
        model.quantize("int4")


def test_engine_int4_option_decodes_a_request() -> None:
    core = EngineCore(EngineConfig(model="random:tiny", dtype="float32", chunk_size=16, num_kv_chunks=16,
                                   quantization="int4"))
    assert core.model.quantization == "int4"
    core.add_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    out = []
    while core.has_work():
        out += core.step()
    assert out and len(out[-1].req.output) == 5


def test_fused_prologues_epilogues_match_torch_norm_swiglu_residual_and_rope() -> None:
    if load_kernel() is None:
        pytest.skip("no C++ compiler: the fused path needs the kernel")
    from chunkserve.workers.quant import fused_block_linear

    g = torch.Generator().manual_seed(5)
    n, k, t, d = 128, 64, 3, 16
    qw = Q4Weight.quantize(torch.randn(n, k, generator=g))
    wd = qw.dequantize()
    ln = torch.rand(k, generator=g) + 0.5
    x = torch.randn(t, k, generator=g) * 3

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert ((got - want).norm() / want.norm()).item() < 2e-2

    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * ln
    f = fused_block_linear(qw, None, torch.float32, norm=(ln, 1e-5))
    close(f(x), F.linear(normed, wd))
    gu = torch.randn(t, 2 * k, generator=g)
    f_glu = fused_block_linear(qw, None, torch.float32, glu=True)
    close(f_glu(gu), F.linear(F.silu(gu[:, :k]) * gu[:, k:], wd))
    h = torch.randn(t, n, generator=g)
    plain = fused_block_linear(qw, None, torch.float32)
    want = h + plain(x)
    assert plain(x, h) is h and torch.allclose(h, want, atol=1e-5)
    ang = torch.rand(t, d // 2, generator=g) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)  # [T, D]
    y = plain(x)
    heads = y[:, :64].view(t, 4, d)
    rot = heads * cos[:, None] + torch.cat((heads[..., d // 2:], heads[..., :d // 2]), -1) * sin[:, None]
    got = plain(x, rope=(cos, sin, 64))
    assert torch.allclose(got[:, :64].view(t, 4, d), rot, atol=1e-5)
    assert torch.equal(got[:, 64:], y[:, 64:])  # the columns past the rotated heads are untouched
    with pytest.raises(ValueError, match="input"):
        plain(torch.randn(t, k + 32))
