"""`WeightArena`: a model's kernel-packed weights moved into one block, in program order, bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from chunkserve.workers.arena import ALIGN, WeightArena
from chunkserve.workers.config import preset_config
from chunkserve.workers.model import CausalLM, DenseCausalAttention
from chunkserve.workers.quant import BlockLinear, Q4Weight, Q8Weight, load_kernel


def _kernel_or_skip() -> None:
    if load_kernel() is None:
        pytest.skip("no C++ compiler: no packed weights to gather")


def test_gathered_weights_lie_in_call_order_in_one_block_and_give_the_same_outputs() -> None:
    _kernel_or_skip()
    kern = load_kernel()
    assert kern is not None
    g = torch.Generator().manual_seed(2)
    calls = [BlockLinear(kern, cls.quantize(torch.randn(n, k, generator=g)), None, torch.bfloat16, torch.float32)
             for cls, n, k in ((Q4Weight, 40, 96), (Q8Weight, 24, 64), (Q4Weight, 200, 32))]
    xs = [torch.randn(3, c.k, generator=g).to(torch.bfloat16) for c in calls]
    want = [c(x) for c, x in zip(calls, xs, strict=True)]
    before = [c.w.clone() for c in calls]
    arena = WeightArena.gather(calls)
    assert arena is not None
    base = arena.buf.data_ptr()
    ptrs = [c.w.data_ptr() for c in calls]
    assert ptrs == sorted(ptrs) and ptrs[0] == base and all(p % ALIGN == 0 for p in ptrs)
    assert ptrs[-1] + calls[-1].w.numel() <= base + arena.buf.numel()
    for c, b in zip(calls, before, strict=True):
        assert c.args.packed == c.w.data_ptr() and torch.equal(c.w, b) and c.w.shape == b.shape
    for c, x, y in zip(calls, xs, want, strict=True):
        assert torch.equal(c(x), y)


def test_an_int4_model_reads_its_layers_and_head_from_one_arena_with_unchanged_logits() -> None:
    _kernel_or_skip()
    cfg = preset_config("tiny")
    model = CausalLM.random(cfg, seed=5, std=0.1)
    model.quantize("int4")
    progs = model._programs
    assert progs is not None and progs.arena is not None
    calls = [f for layer in progs.fns for f in layer] + [model._head]
    assert all(isinstance(c, BlockLinear) for c in calls)
    ptrs = [c.w.data_ptr() for c in calls]  # layer by layer (qkv, o, gate_up, down), the lm_head last
    assert ptrs == sorted(ptrs)
    ids, pos = torch.arange(5, 25), torch.arange(20)
    got = model.compute_logits(model.forward(ids, pos, DenseCausalAttention(cfg.num_layers)))
    for c in calls:  # the same bytes, each in its own tensor again
        c.w = c.w.clone()
        c.args.packed = c.w.data_ptr()
    want = model.compute_logits(model.forward(ids, pos, DenseCausalAttention(cfg.num_layers)))
    assert torch.equal(got, want)


def test_gathering_nothing_makes_no_arena() -> None:
    assert WeightArena.gather([]) is None
