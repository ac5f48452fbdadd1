"""A step on an accelerator reads nothing back from the device but its sampled ids (issue 13).

The engine runs on torch's ``meta`` device with the GPU's code paths (Triton attention and prefill,
accelerator sampling; see `sync_probe`). Every step must make exactly one device -> host read (the
sampled ids and the logprobs asked for, in one copy), no ``.item()``-style read, and exactly one
host -> device copy, non-blocking (the step's staged metadata, sampler knobs included).
"""

from __future__ import annotations

import pytest
import torch

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.model import CausalLM
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.weights import LoadedModel, load_model
from tests.workers.sync_probe import probe, stub_triton

META = torch.device("meta")
CHUNK = 16


def meta_engine(dtype: torch.dtype = torch.float16, num_kv_chunks: int = 64) -> EngineCore:
    """A tiny random Llama on the meta device, served with the GPU's backends (no warm-up: the
    Triton kernels are stubbed only inside `stub_triton`)."""
    cpu = load_model("random:tiny", dtype="float32", tokenizer=False)
    sd = {k: v.to(META) for k, v in cpu.model.state_dict().items()}
    model = CausalLM.from_state_dict(cpu.config, sd, dtype=dtype, device=META)
    cfg = EngineConfig(device="meta", chunk_size=CHUNK, num_kv_chunks=num_kv_chunks, attention_backend="triton",
                       prefill_backend="triton", prepack_weights=False, max_num_batched_tokens=256, warmup=False)
    return EngineCore(cfg, LoadedModel(model, None, cpu.config))


def prompts() -> list[list[int]]:
    shared = list(range(3, 3 + 2 * CHUNK))  # two full chunks shared by every request: phase 1 runs
    return [shared + [40 + i] * (i + 1) for i in range(4)]


PARAMS = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=0.8, top_k=5, seed=1, ignore_eos=True, logprobs=True),
          SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_step_reads_back_only_its_sampled_ids_and_copies_its_metadata_once(dtype: torch.dtype) -> None:
    eng = meta_engine(dtype)
    kernels_per_step = []
    with stub_triton(META) as launches:
        for i, (p, params) in enumerate(zip(prompts(), PARAMS, strict=True)):
            eng.add_request(f"r{i}", p, params)
        while eng.has_work():
            with probe() as ev:
                outs = eng.step()
            step = len(kernels_per_step)
            assert len(outs) == 4, f"step {step}: {len(outs)} outputs"
            assert ev.reads == ["to_host"], f"step {step}: device reads {ev.reads}"
            assert ev.h2d_blocking == [], f"step {step}: blocking host -> device copies {ev.h2d_blocking}"
            assert ev.h2d_async == 1, f"step {step}: {ev.h2d_async} host -> device copies"
            kernels_per_step.append({launch.kernel for launch in launches})
            launches.clear()
    # the probe watched a prefill step, then decode steps with a shared run (phase 1) and private chunks
    assert kernels_per_step[0] == {"_prefill_kernel"}
    assert len(kernels_per_step) == 4 and all(k == {"_tpp_phase1", "_tpp_phase2"} for k in kernels_per_step[1:])


def test_the_probe_sees_the_reads_it_must_forbid() -> None:
    """The probe is not blind: each way of reading the device (and of a blocking copy) is counted."""
    x = torch.ones(4, device=META)
    with probe() as ev:
        x.tolist()
        int(x[0])
        bool(x[1] > 0)
        x.cpu()
        torch.tensor([1, 2], device=META)
        x.copy_(torch.ones(4))
        x.copy_(torch.ones(4), non_blocking=True)
    assert ev.reads == ["to_host", "item", "item", "to_host"]
    assert ev.h2d_blocking == ["tensor(host data)", "copy_"] and ev.h2d_async == 1
