"""The HF baseline of `chunkserve bench e2e` runs its linears prepacked for oneDNN, as chunkserve's engine
does, and computes the same logits."""

from __future__ import annotations

import pytest
import torch

from chunkserve.tools.bench_util import prepack_hf_linears
from chunkserve.workers.linear import onednn_packing_available


@pytest.mark.skipif(not onednn_packing_available(torch.float32, torch.device("cpu")), reason="no oneDNN packing")
def test_prepacked_hf_model_computes_the_same_logits_through_every_linear() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (3, 9))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        n = prepack_hf_linears(model, batch_hint=3)
        got = model(input_ids=ids).logits
    assert n == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        for mod in model.modules():  # the packed copies are what runs now: the module weights no longer count
            if isinstance(mod, torch.nn.Linear):
                mod.weight.zero_()
        assert torch.equal(model(input_ids=ids).logits, got)
