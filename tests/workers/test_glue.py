"""The dense layers' glue calls (`workers/glue.py`) against the ATen ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkserve.workers.config import ModelConfig
from chunkserve.workers.glue import Glue, load_glue
from chunkserve.workers.model import CausalLM, DenseCausalAttention

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def glue() -> Glue:
    g = load_glue()
    if g is None:
        pytest.skip("no C++ compiler for the glue kernel")
    return g


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, tol: float = 2e-6) -> None:
    """ATen's roundings, but the norm's sum in another order and SwiGLU's own exp: fp32 within the last bits,
    bf16 within one bf16 step (2^-8 relative) and nearly every value equal."""
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)
        assert (got != want).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 20])  # vector rows, and rows the scalar loop finishes
def test_add_rms_norm_adds_in_place_and_normalises_as_transformers(glue: Glue, dtype: torch.dtype,
                                                                    width: int) -> None:
    g = torch.Generator().manual_seed(0)
    h, r = (torch.randn(5, width, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(width, generator=g).add(0.5).to(dtype)
    want_h = h + r
    xf = want_h.float()
    want = (xf * xf.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()).to(dtype) * w
    got = glue.add_rms_norm(h, r, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual add landed in h
    _close(got, want, dtype)
    unchanged = h.clone()
    _close(glue.add_rms_norm(h, None, w, 1e-5), want, dtype)  # no add: h is left alone
    assert torch.equal(h, unchanged)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "d"), [(12, 64), (3, 6)])
def test_rope_rotates_the_first_columns_in_place_and_leaves_the_rest(glue: Glue, dtype: torch.dtype, heads: int,
                                                                     d: int) -> None:
    g = torch.Generator().manual_seed(1)
    t, cols = 4, heads * d
    x = torch.randn(t, cols + 2 * d, generator=g).to(dtype)  # q and k heads, then v's
    cos, sin = (torch.randn(t, 1, d, generator=g).to(dtype) for _ in range(2))
    qk = x[:, :cols].view(t, heads, d)
    want = torch.cat((qk[..., d // 2:], qk[..., :d // 2]), -1).mul_(sin).addcmul_(qk, cos)
    v = x[:, cols:].clone()
    glue.rope_(x, cos, sin, cols)
    if dtype == torch.bfloat16:  # no sum, ATen's roundings (products of bf16 values are exact in fp32)
        assert torch.equal(x[:, :cols].view(t, heads, d), want)
    else:  # the compiler may fuse x * cos + t into one rounding
        _close(x[:, :cols].view(t, heads, d), want, dtype)
    assert torch.equal(x[:, cols:], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul_is_swiglu_of_the_gate_and_up_halves(glue: Glue, dtype: torch.dtype, inter: int) -> None:
    gu = (torch.randn(6, 2 * inter, generator=torch.Generator().manual_seed(2)) * 6).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)  # exp's ends: silu -> 0 and -> x
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    _close(glue.silu_mul(gu), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_across_threads_give_the_one_thread_result(glue: Glue, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    big = torch.randn(256, 600, generator=g).to(dtype)  # rows with a leading dimension > H
    h, r, w = big[:, :576], torch.randn(256, 576, generator=g).to(dtype), torch.rand(576, generator=g).to(dtype)
    gu = torch.randn(256, 3072, generator=g).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 2):  # 256 x 576 and 256 x 4608 values: over the kernel's serial bound, OpenMP on 2 threads
        torch.set_num_threads(n)
        try:
            hh = h.clone()
            outs.append((glue.add_rms_norm(hh, r, w, 1e-5), hh, glue.silu_mul(gu)))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][1], h + r)
    assert glue.add_rms_norm(h[:0], None, w, 1e-5).shape == (0, 576)  # an empty step


def test_glue_refuses_mixed_dtypes_and_short_rope_tables(glue: Glue) -> None:
    h = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="add_rms_norm"):
        glue.add_rms_norm(h, None, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="rope_"):
        glue.rope_(h, torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), 64)  # factors for 1 row, x has 4


def test_rope_refuses_columns_that_are_not_whole_heads(glue: Glue) -> None:
    x, cs = torch.zeros(2, 64), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="cs_g_rope refused"):
        glue.rope_(x, cs, cs, 60)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_with_the_glue_matches_the_aten_layer_loop(glue: Glue, dtype: torch.dtype) -> None:
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=128)
    model = CausalLM.random(cfg, dtype=dtype, std=0.2)
    model.norm.uniform_(0.5, 1.5)
    for lw in model.layers:
        lw.ln1.uniform_(0.5, 1.5)
        lw.ln2.uniform_(0.5, 1.5)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9)
    outs = []
    for on in (True, False):
        model.glue_layers = on
        outs.append(model.forward(ids, pos, DenseCausalAttention(cfg.num_layers)))
    assert model._glue is glue
    _close(outs[0], outs[1], dtype, tol=2e-5)  # fp32: last-bit differences carried through three layers
