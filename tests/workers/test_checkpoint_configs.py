"""What a checkpoint's configs say beyond the weights: a sliding window on Qwen2 layers, the end-of-sequence
ids of ``generation_config.json``, and a context shorter than a chunk (the warm-up must fit in it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

from chunkserve.workers.config import ModelConfig
from chunkserve.workers.llm import LLM
from chunkserve.workers.sampling import SamplingParams

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("kw", "window"), [
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}, 32),
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}, None),  # no layer past it
    ({"use_sliding_window": False, "sliding_window": 32}, None),
])
def test_a_qwen2_sliding_window_caps_the_context_where_full_attention_agrees(kw: dict, window: int | None) -> None:
    """The window was read for Mistral only: a Qwen2 model with sliding layers attended to the whole context
    and gave other tokens than HF from the first one, for prompts past the window."""
    hf = Qwen2Config(**TINY, max_position_embeddings=2048, **kw)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.sliding_window == window
    assert cfg.max_model_len == (window or 2048)


def _llama_dir(tmp_path: Path, **kw: object) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "max_position_embeddings": 512, "eos_token_id": 2, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    return path, model


def test_the_eos_ids_of_generation_config_end_the_output_as_in_hf(tmp_path: Path) -> None:
    """Llama-3-Instruct lists its end-of-turn token only in generation_config.json: without it the output ran
    past that token to max_tokens."""
    path, _ = _llama_dir(tmp_path)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    llm = LLM(model=str(path), dtype="float32", chunk_size=16, num_kv_chunks=64, warmup=False)
    free = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = free[2]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    llm = LLM(model=str(path), dtype="float32", chunk_size=16, num_kv_chunks=64, warmup=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.token_ids == free[:free.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_a_context_no_longer_than_a_chunk_still_warms_up_and_serves(tmp_path: Path, chunk_size: int) -> None:
    """The warm-up's prompts were a chunk and 2 tokens long: the engine could not be built (position 65 exceeds
    max_position_embeddings 64)."""
    path, _ = _llama_dir(tmp_path, max_position_embeddings=64)
    llm = LLM(model=str(path), dtype="float32", chunk_size=chunk_size, num_kv_chunks=16)
    out = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
