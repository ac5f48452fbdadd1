"""Our Llama-family forward against transformers' eager LlamaForCausalLM on the same random weights."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chunkserve.workers.config import ModelConfig, preset_config
from chunkserve.workers.model import CausalLM, DenseCausalAttention, rope_inv_freq
from chunkserve.workers.quant import load_kernel

VOCAB = 320


def _hf_llama(heads: int, kv_heads: int, head_dim: int, hidden: int, *, tie: bool = False,
              rope: dict[str, Any] | None = None, seed: int = 0) -> LlamaForCausalLM:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden // 2 + 8,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_parameters=rope_parameters, tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # make the norms non-trivial so a missing weight multiply would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return hf


def _ours(hf: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> CausalLM:
    return CausalLM.from_state_dict(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=dtype)


def _logits(model: CausalLM, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    attn = DenseCausalAttention(model.config.num_layers)
    pos = torch.arange(start, start + ids.numel())
    return model.compute_logits(model.forward(ids, pos, attn))


SHAPES = [  # (heads, kv_heads, head_dim, hidden, tied)
    pytest.param(8, 2, 128, 256, False, id="8h-2kv-d128"),
    pytest.param(9, 3, 64, 576, True, id="smollm-9h-3kv-d64-tied"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "hidden", "tie"), SHAPES)
def test_forward_matches_transformers_llama_eager(heads: int, kv_heads: int, head_dim: int, hidden: int,
                                                   tie: bool) -> None:
    hf = _hf_llama(heads, kv_heads, head_dim, hidden, tie=tie)
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()  # [T, V]
    out = _logits(_ours(hf), ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
], ids=["linear", "llama3", "yarn"])
def test_rope_scaling_matches_transformers(rope: dict[str, Any]) -> None:
    hf = _hf_llama(4, 2, 32, 128, rope=rope)
    ours = _ours(hf)
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling["rope_type"] == rope["rope_type"]
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    start = 300  # far positions, where the scaled frequencies differ most
    with torch.no_grad():
        ref = hf(ids[None], position_ids=torch.arange(start, start + 24)[None]).logits[0]
    out = _logits(ours, ids, start=start)
    assert (out - ref).abs().max().item() < 1e-4
    unscaled = dataclasses.replace(ours.config, rope_scaling=None)
    assert not torch.allclose(rope_inv_freq(unscaled)[0], rope_inv_freq(ours.config)[0])


@pytest.mark.parametrize("rtype", ["dynamic", "longrope"])
def test_unimplemented_rope_scaling_raises(rtype: str) -> None:
    with pytest.raises(NotImplementedError, match=rtype):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, rope_scaling={"rope_type": rtype, "factor": 2.0})


def test_incremental_decode_equals_full_sequence() -> None:
    hf = _hf_llama(8, 2, 128, 256)
    ours = _ours(hf)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    full = _logits(ours, ids)
    attn = DenseCausalAttention(ours.config.num_layers)
    rows = [ours.compute_logits(ours.forward(ids[:12], torch.arange(12), attn))[-1:]]
    for p in range(12, 20):
        rows.append(ours.compute_logits(ours.forward(ids[p:p + 1], torch.tensor([p]), attn)))
    step = torch.cat(rows)  # logits for positions 11..19
    assert (step - full[11:]).abs().max().item() < 1e-4


def test_flattened_batch_of_two_sequences_matches_each_alone() -> None:
    """Rows are independent except through attention: the engine's flattened T-batch layout works."""
    hf = _hf_llama(9, 3, 64, 576, tie=True)
    ours = _ours(hf)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, VOCAB, (9,), generator=g), torch.randint(0, VOCAB, (5,), generator=g)
    attn_a, attn_b = DenseCausalAttention(2), DenseCausalAttention(2)

    def split_attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [14, Hq, D] -> o: [14, Hq, D]; rows 0..8 belong to a, 9..13 to b
        return torch.cat((attn_a(layer, q[:9], k[:9], v[:9]), attn_b(layer, q[9:], k[9:], v[9:])))

    ids = torch.cat((a, b))
    pos = torch.cat((torch.arange(9), torch.arange(5)))
    both = ours.compute_logits(ours.forward(ids, pos, split_attn))
    assert (both[:9] - _logits(ours, a)).abs().max().item() < 1e-4
    assert (both[9:] - _logits(ours, b)).abs().max().item() < 1e-4


def test_bf16_forward_tracks_fp32() -> None:
    hf = _hf_llama(8, 2, 128, 256)
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    ref = _logits(_ours(hf), ids)
    low = _logits(_ours(hf, torch.bfloat16), ids)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_bf16_prepacked_weights_give_identical_logits() -> None:
    hf = _hf_llama(9, 3, 64, 576, tie=True)
    ids = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(6))
    ours = _ours(hf, torch.bfloat16)
    plain = _logits(ours, ids)
    if not ours.prepack():
        pytest.skip("this CPU/ATen build has no oneDNN bf16 packed linear")
    assert ours._packed is not None and len(ours._packed) == ours.config.num_layers
    assert torch.equal(_logits(ours, ids), plain)


def test_fp32_prepacked_weights_match_plain_logits_to_rounding() -> None:
    hf = _hf_llama(9, 3, 64, 576, tie=True)
    ids = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(6))
    ours = _ours(hf)
    plain = _logits(ours, ids)
    if not ours.prepack():
        pytest.skip("this CPU/ATen build has no oneDNN packed linear")
    assert ours._packed is not None and ours._packed_head is not None
    packed = _logits(ours, ids)
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_random_model_is_seeded_and_state_dict_roundtrips() -> None:
    cfg = preset_config("tiny")
    m1 = CausalLM.random(cfg, seed=7)
    m2 = CausalLM.from_state_dict(cfg, m1.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(6))
    assert torch.equal(_logits(m1, ids), _logits(m2, ids))
    assert not torch.equal(_logits(m1, ids), _logits(CausalLM.random(cfg, seed=8), ids))


def test_forward_rejects_bad_shapes_and_positions() -> None:
    m = CausalLM.random(preset_config("tiny"))
    attn = DenseCausalAttention(m.config.num_layers)
    with pytest.raises(ValueError, match="1-D"):
        m.forward(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), attn)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m.forward(torch.zeros(1, dtype=torch.long), torch.tensor([m.config.max_position_embeddings]), attn)


def test_config_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3, num_kv_heads=2,
                    head_dim=4)
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"vocab_size": 8, "hiden_size": 8})
    assert 6.6e9 < preset_config("llama-7b").num_params() < 6.8e9


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_forward_with_keep_rows_gives_the_rows_a_full_forward_gives(quant: str | None) -> None:
    """``keep``: only the rows that sample come back; block-quantised layers run the last layer's o-projection and MLP
    on those rows alone (row-invariant calls), so they are the same bits as the full pass's rows."""
    cfg = dataclasses.replace(preset_config("tiny"), vocab_size=VOCAB)  # sizes of 32s: the block kernel's layers
    ours = CausalLM.random(cfg, dtype=torch.bfloat16, seed=3, std=0.2)
    if quant is not None:
        ours.quantize(quant)
        assert ours._fused or load_kernel() is None  # the fused path wherever the kernel builds
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(ids.numel())
    full = ours.forward(ids, pos, DenseCausalAttention(cfg.num_layers))
    keep = torch.tensor([20, 3, 11])
    got = ours.forward(ids, pos, DenseCausalAttention(cfg.num_layers), keep=keep)
    assert got.shape == (3, cfg.hidden_size) and torch.equal(got, full.index_select(0, keep))
    assert ours.forward(ids, pos, DenseCausalAttention(cfg.num_layers), keep=keep[:0]).shape == (0, cfg.hidden_size)
