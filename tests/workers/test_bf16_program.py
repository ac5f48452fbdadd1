"""bf16 weights in the block kernel (`B16Weight`, ``csrc/b16.h``) and the bf16 decode program of few rows (batch
and thread invariance: `test_quant_block.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkserve.workers import step_program
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.quant import B16Weight, block_linear, load_kernel
from chunkserve.workers.sampling import SamplingParams

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the kernel is not built")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_bf16_block_linear_equals_the_fp32_matmul_of_its_bf16_operands(out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(83, 96, generator=g).bfloat16(), torch.randn(83, generator=g)  # 83: a partial row group
    fn = block_linear(B16Weight.quantize(w), b.to(out_dtype), torch.bfloat16, out_dtype)
    for rows in (1, 3, 8, 9, 16, 70):  # narrow and wide tiles, more than one activation piece
        x = torch.randn(rows, 96, generator=g).bfloat16()
        got = fn(x)
        want = F.linear(x.float(), w.float(), b.to(out_dtype).float())
        assert got.dtype == out_dtype and got.shape == (rows, 83)
        # fp32 sums of exact bf16 products: only the order of the sums (and a bf16 output's rounding) differ
        tol = 1e-5 if out_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def _generate(core: EngineCore, prompts: dict[str, list[int]], tokens: int = 10) -> dict[str, list[float]]:
    for rid, ids in prompts.items():
        core.add_request(rid, ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        for out in core.step():
            got[out.req.request_id].extend(out.token_ids)
    return got


def test_bf16_engine_runs_decode_steps_of_few_rows_as_one_bf16_program_call(monkeypatch: pytest.MonkeyPatch) -> None:
    kern = load_kernel()
    if kern is None or not kern.native_bf16:
        pytest.skip("the bf16 program needs AVX512-BF16")
    calls: list[int] = []
    real = step_program.StepProgram.run

    def run(prog: step_program.StepProgram, layers: step_program.DecodeLayers) -> torch.Tensor:
        calls.append(prog.t)
        return real(prog, layers)

    monkeypatch.setattr(step_program.StepProgram, "run", run)
    core = EngineCore(EngineConfig(model="random:tiny", dtype="bfloat16", chunk_size=16, num_kv_chunks=128,
                                   num_threads=1))
    assert core.model._bf16_programs is not None and core.model._programs is None
    calls.clear()  # warm-up's steps
    few = {"one": [5, 6, 7, 8, 9], "two": list(range(40, 61))}
    got = _generate(core, few)
    assert set(calls) == {2} and len(calls) >= 9  # every decode step (two rows; the first token is prefill's)
    # the oneDNN path computes the same model: greedy tokens agree (random:tiny has no near ties here)
    core.model.step_programs = False
    assert _generate(core, few) == got
    calls.clear()
    core.model.step_programs = True
    many = {f"r{i}": [3 + i] * 6 for i in range(step_program.BF16_PROGRAM_ROWS + 1)}
    _generate(core, many, tokens=3)
    assert max(calls, default=0) <= step_program.BF16_PROGRAM_ROWS  # a step of more rows keeps oneDNN


def test_bf16_head_gives_fp32_logits_of_the_onednn_head_for_few_rows() -> None:
    kern = load_kernel()
    if kern is None or not kern.native_bf16:
        pytest.skip("the bf16 program needs AVX512-BF16")
    model = EngineCore(EngineConfig(model="random:tiny", dtype="bfloat16", chunk_size=16, num_kv_chunks=64)).model
    progs = model._bf16_programs
    assert progs is not None and progs.head is not None
    hidden = torch.randn(step_program.BF16_PROGRAM_ROWS, model.config.hidden_size).bfloat16()
    got = model.compute_logits(hidden)
    want = F.linear(hidden.float(), model.lm_head.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())  # fp32 sums, not rounded
    model.step_programs = False
    assert not torch.equal(model.compute_logits(hidden), got)  # the oneDNN head rounds its output to bf16


def test_fp32_models_get_no_bf16_program() -> None:
    core = EngineCore(EngineConfig(model="random:tiny", dtype="float32", chunk_size=16, num_kv_chunks=64))
    assert core.model._bf16_programs is None
