"""A decode step's layer loop as one foreign call (`workers/step_program.py`): same results, used when it can be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkserve.workers import step_program
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.quant import load_kernel
from chunkserve.workers.sampling import SamplingParams

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the program needs the kernel")


def _core(dtype: str = "float32", **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model="random:tiny", dtype=dtype, chunk_size=16, num_kv_chunks=64,
                                   quantization="int4", **kw))  # type: ignore[arg-type]


def _generate(core: EngineCore, prompts: dict[str, list[int]], tokens: int = 12) -> dict[str, tuple]:
    for rid, ids in prompts.items():
        core.add_request(rid, ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=True))
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in prompts}
    while core.has_work():
        for out in core.step():
            got[out.req.request_id][0].extend(out.token_ids)
            got[out.req.request_id][1].extend(out.logprobs or [])
    return {rid: (tuple(ids), tuple(lps)) for rid, (ids, lps) in got.items()}


class _Counting:
    """Counts `StepProgram.run` calls while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = step_program.StepProgram.run

        def run(prog: step_program.StepProgram, layers: step_program.DecodeLayers) -> torch.Tensor:
            self.calls += 1
            return real(prog, layers)

        monkeypatch.setattr(step_program.StepProgram, "run", run)


@pytest.mark.parametrize(("threads", "dtype"), [(1, "float32"), (2, "float32"), (1, "bfloat16")])
def test_decode_steps_run_as_one_call_and_give_the_python_loops_tokens_and_logprobs(
        threads: int, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = {"one": [5, 6, 7, 8, 9], "two": list(range(40, 61)), "three": [3] * 33}
    loop = _core(dtype, num_threads=threads)
    loop.model.step_programs = False
    want = _generate(loop, prompts)
    counting = _Counting(monkeypatch)
    core = _core(dtype, num_threads=threads)
    assert _generate(core, prompts) == want  # bitwise: the same calls in the same order
    assert counting.calls >= 11  # every decode-only step (3 rows, then fewer as requests finish)
    assert _generate(core, {"alone": [9, 8, 7]}) == _generate(loop, {"alone": [9, 8, 7]})  # batch 1


def test_steps_with_a_shared_prefix_run_as_one_call_too(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _Counting(monkeypatch)
    core = _core(num_threads=1)
    shared = list(range(10, 60))  # three chunks of 16 shared by both requests: TPP's shared runs
    loop = _core(num_threads=1)
    loop.model.step_programs = False
    prompts = {"a": shared + [1, 2], "b": shared + [3, 4]}
    assert _generate(core, prompts) == _generate(loop, prompts)
    assert counting.calls >= 11  # every decode step; the prefill step keeps the Python loop


def test_a_failing_call_raises_with_its_layer_and_code() -> None:
    core = _core(num_threads=1)
    programs = core.model._programs
    assert programs is not None
    prog = programs._get(2)
    prog._ops[0, 4] = -1  # layer 0's qkv linear over -1 rows: the kernel refuses it (code -1)
    null = SimpleNamespace(fn_addr=0, plan_addr=0)  # never reached
    layers = step_program.DecodeLayers(layer=null, k_pools=prog._attn_rows * 0,  # type: ignore[arg-type]
                                       v_pools=prog._attn_rows * 0)
    with pytest.raises(RuntimeError, match="layer 0, call 0 with code -1"):
        prog.run(layers)
