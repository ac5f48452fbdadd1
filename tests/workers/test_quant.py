"""int8: Q8_0 blocks where every input size is a multiple of 32, else weight-only per-channel int8 (the
quantiser's error bound, its matmul); the model and engine options."""

from __future__ import annotations

import pytest
import torch

from chunkserve.workers.config import ModelConfig, preset_config
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.linear import Int8Weight, int8_linear, plain_linear
from chunkserve.workers.model import CausalLM, DenseCausalAttention
from chunkserve.workers.quant import Q8Weight
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.weights import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "The French Revolution began in",
           "In mathematics, a prime number is", "The largest planet in our solar system"]
TEXT = ("The river had always been the town's clock. In spring it rose brown and fast with snowmelt from the "
        "hills, and the ferryman would wait for the water to settle before he took anyone across. In summer it "
        "slowed and warmed, and children spent whole afternoons on the gravel bars, building dams that the "
        "evening current quietly took apart.")


def _logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    x = torch.tensor(ids)
    hidden = model.forward(x, torch.arange(len(ids)), DenseCausalAttention(model.config.num_layers))
    return model.compute_logits(hidden)  # [T, V] fp32


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int8_dequantised_weights_are_within_one_127th_of_each_channels_max(scale_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # channel scales over 4 decades
    w[7] = 0.0  # an all-zero channel
    qw = Int8Weight.quantize(w, scale_dtype)
    assert qw.q.dtype == torch.int8 and qw.q.shape == w.shape and qw.scale.shape == (64,)
    assert qw.scale.dtype == scale_dtype and int(qw.q.abs().max()) <= 127
    err = (qw.dequantize() - w).abs().amax(dim=1)  # [64]
    bound = w.abs().amax(dim=1) / 127
    assert bool((err <= bound).all())
    assert bool((err > 0).any())  # it does quantise
    assert torch.equal(qw.dequantize()[7], torch.zeros(96))


@pytest.mark.parametrize("k", [64, 72, 40])  # ATen's kernel takes K in steps of 16; 72 and 40 go around it
def test_int8_linear_equals_the_dequantised_matmul_up_to_bf16_rounding(k: int) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, k, generator=g), torch.randn(40, generator=g)
    qw = Int8Weight.quantize(w)
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=g)
        got = int8_linear(qw, b, torch.float32)(x)
        want = plain_linear(qw.dequantize(), b)(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 40)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _odd_config() -> ModelConfig:
    """A shape whose input sizes (72, 144) are not multiples of 32: no block format fits."""
    return ModelConfig(vocab_size=512, hidden_size=72, intermediate_size=144, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=12, max_position_embeddings=256)


@pytest.mark.parametrize(("cfg", "cls", "head"), [(preset_config("tiny"), Q8Weight, Q8Weight),
                                                  (_odd_config(), Int8Weight, torch.Tensor)],
                         ids=["q8_0-blocks", "per-channel-fallback"])
def test_int8_model_tracks_fp32_and_exports_dequantised_weights(cfg: ModelConfig, cls: type, head: type) -> None:
    ref = CausalLM.random(cfg, seed=3, std=0.1)
    model = CausalLM.random(cfg, seed=3, std=0.1)
    model.quantize("int8")
    assert model.quantization == "int8" and isinstance(model.lm_head, head)
    assert all(isinstance(w, cls) for lw in model.layers for w, _ in lw.matmuls())
    assert isinstance(model.embed, torch.Tensor) and torch.equal(model.embed, ref.embed)  # stays dense
    ids = list(range(5, 25))
    a, b = _logits(ref, ids), _logits(model, ids)
    assert not torch.equal(a, b)
    assert ((a - b).norm() / a.norm()).item() < 0.05
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert sd.keys() == ref.state_dict().keys()
    with pytest.raises(ValueError, match="already"):
        model.quantize("int8")


def test_int8_per_channel_fallback_quantises_the_head_only_when_asked() -> None:
    model = CausalLM.random(_odd_config(), seed=1)
    model.quantize("int8", lm_head=True)
    assert isinstance(model.lm_head, Int8Weight)
    tiny = CausalLM.random(preset_config("tiny"), seed=1)
    tiny.quantize("int8", lm_head=False)
    assert isinstance(tiny.lm_head, torch.Tensor)
    with pytest.raises(ValueError, match="multiple of 32"):
        CausalLM.random(_odd_config(), seed=1).quantize("int4")


@pytest.mark.parametrize("bad", ["int3", "INT8", "fp8", ""])
def test_invalid_quantization_value_raises_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="random:tiny", quantization=bad)
    with pytest.raises(ValueError, match="quantization"):
        CausalLM.random(preset_config("tiny")).quantize(bad)


def test_engine_int8_option_runs_q8_0_layers_and_head_and_decodes_like_its_dequantised_weights() -> None:
    cfg = EngineConfig(model="random:tiny", dtype="float32", chunk_size=16, num_kv_chunks=16, quantization="int8")
    core = EngineCore(cfg)
    m = core.model
    assert m.quantization == "int8" and isinstance(m.lm_head, Q8Weight)
    assert all(isinstance(w, Q8Weight) for lw in m.layers for w, _ in lw.matmuls())
    core.add_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    out = []
    while core.has_work():
        out += core.step()
    assert out and len(out[-1].req.output) == 5


@pytest.mark.slow
def test_int8_smollm2_mostly_agrees_with_fp32_greedy_and_teacher_forced() -> None:
    fp32 = load_model(None, dtype="float32", progress=False)
    int8 = load_model(None, dtype="float32", progress=False)
    int8.model.quantize("int8")
    tok = fp32.tokenizer
    ids = tok.encode(TEXT)
    a, b = _logits(fp32.model, ids), _logits(int8.model, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.8  # measured 0.91 (AVX2, 70 tokens)
    assert isinstance(int8.model.lm_head, Q8Weight)
    outs = []
    for loaded in (fp32, int8):
        core = EngineCore(EngineConfig(dtype="float32", kv_cache_gb=0.1), loaded)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            core.add_request(f"p{i}", tok.encode(p), params)
        done = {}
        while core.has_work():
            for o in core.step():
                if o.finish_reason is not None:
                    done[o.req.request_id] = list(o.req.output)
        outs.append([done[f"p{i}"] for i in range(len(PROMPTS))])
    prefix = []
    for r, g in zip(*outs, strict=True):
        prefix.append(next((i for i, (x, y) in enumerate(zip(r, g, strict=True)) if x != y), len(r)) / len(r))
    assert sum(prefix) / len(prefix) >= 0.4  # measured 0.62 (AVX2): a 135M model diverges on near-ties
    assert max(prefix) == 1.0
