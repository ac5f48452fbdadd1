"""The offline LLM on the embedded SmolLM2-135M-Instruct equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.workers.weights import embedded_checkpoint_dir

pytestmark = pytest.mark.slow

SYSTEMS = [
    "You are a helpful assistant for a bookshop. Answer briefly. " * 6,
    "You are a weather bot. Tools: get_weather(city), get_forecast(city, days). " * 10,
]
QUESTIONS = ["What is 2+2?", "Name a primary color.", "Say hello in French.", "Is it raining in Paris?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(chunk_size=32, num_kv_chunks=256, dtype="float32")  # fp32 on every CPU: compared with HF fp32


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    # The cached conversion holds the GGUF's de-quantised weights (tests/workers/test_weights.py checks
    # that transformers loads identical logits from both); it loads in ~2 s instead of ~15 s.
    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_dir(), dtype=torch.float32).eval()
    model.refs = {}  # prompt -> greedy continuation, shared by the parametrized cases
    return model


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": q}]
            for i, q in enumerate(QUESTIONS)]


@pytest.mark.parametrize("share", [True, False])
def test_chat_greedy_matches_hf_with_shared_system_prompts(llm: LLM, hf_model, share: bool) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine_share = llm.engine.cache.share_prefix
    llm.engine.cache.share_prefix = share
    try:
        outs = llm.chat(conversations(), params)
    finally:
        llm.engine.cache.share_prefix = engine_share
    eos = set(llm.engine.eos_ids)
    for out in outs:
        key = tuple(out.prompt_token_ids)
        if key not in hf_model.refs:
            with torch.no_grad():
                ref = hf_model.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=12, do_sample=False)
            hf_model.refs[key] = ref[0, len(out.prompt_token_ids):].tolist()
        ref_ids = hf_model.refs[key]
        if ref_ids and ref_ids[-1] in eos:
            assert out.finish_reason == "stop"
        assert out.token_ids == ref_ids
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if share:
        assert sum(o.num_cached_tokens for o in outs) > 0
    st = llm.stats()
    for key in ("kv_chunks_used", "kv_chunks_total", "peak_kv_bytes", "prefix_cached_tokens"):
        assert key in st
