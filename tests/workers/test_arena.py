"""`WeightArena`: a model's kernel-packed weights moved into one block, in program order, bitwise unchanged;
`HugeBlock` under it and under the chunk pool."""

from __future__ import annotations

import pytest
import torch

from chunkserve.workers.arena import ALIGN, HUGE_PAGE, HugeBlock, WeightArena
from chunkserve.workers.chunk_pool import ChunkPool
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


def test_a_huge_block_is_zeroed_writable_and_starts_on_a_huge_page_boundary() -> None:
    blk = HugeBlock(3 * HUGE_PAGE + 100)
    assert blk.buf.numel() == 3 * HUGE_PAGE + 100 and blk.buf.dtype == torch.uint8
    assert int(blk.buf.count_nonzero()) == 0
    if blk.huge:  # the mapping was advised: the block starts on a 2 MiB page
        assert blk.buf.data_ptr() % HUGE_PAGE == 0
    x = blk.view(torch.bfloat16, (2, 3, HUGE_PAGE // 4))  # 3 MiB of the block, viewed in place
    x.fill_(1.5)
    assert blk.buf.data_ptr() == x.data_ptr() and x.is_contiguous() and float(x.sum()) == 1.5 * x.numel()
    with pytest.raises(RuntimeError):
        blk.view(torch.float32, (HUGE_PAGE,))  # 8 MiB: more than the block holds


def test_the_cpu_chunk_pool_lies_in_two_huge_blocks_and_reads_as_zeros() -> None:
    pool = ChunkPool(3, 2, 16, 8, 40, torch.bfloat16, "cpu")
    shape = (3, 2, 40, 8, 16)
    for t, blk in zip((pool.k_pool, pool.v_pool), pool._blocks, strict=True):
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert t.data_ptr() == blk.buf.data_ptr() and int(t.count_nonzero()) == 0
    pool.k_pool[1, 0, 7, 2].fill_(3.0)  # K and V are separate memory
    assert int(pool.v_pool.count_nonzero()) == 0 and int(pool.k_pool.count_nonzero()) == 16
