"""Weight loading: local HF dirs (Llama, Qwen2 biases, Mistral), random presets, the embedded SmolLM2 GGUF."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from chunkserve.workers.config import ModelConfig
from chunkserve.workers.model import CausalLM, DenseCausalAttention
from chunkserve.workers.weights import (
    cache_root,
    embedded_checkpoint_dir,
    embedded_gguf_path,
    load_model,
    save_checkpoint,
)

VOCAB = 256
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _logits(model: CausalLM, ids: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    return model.compute_logits(model.forward(ids, torch.arange(ids.numel()), DenseCausalAttention(
        model.config.num_layers)))


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _write_hf_dir(tmp_path: Path, hf_config: object) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():  # transformers zero-initialises biases; make them matter
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(str(tmp_path))
    _tiny_tokenizer().save_pretrained(str(tmp_path))
    return tmp_path, hf


@pytest.mark.parametrize("kind", ["qwen2-tied", "mistral", "llama-biases"])
def test_local_hf_dir_loads_and_matches_transformers(tmp_path: Path, kind: str) -> None:
    if kind == "qwen2-tied":
        cfg = Qwen2Config(**_SMALL, tie_word_embeddings=True)
    elif kind == "mistral":
        cfg = MistralConfig(**_SMALL, head_dim=16, sliding_window=128)
    else:
        cfg = LlamaConfig(**_SMALL, attention_bias=True, mlp_bias=True)
    path, hf = _write_hf_dir(tmp_path, cfg)
    model, tok, mc = load_model(str(path), dtype="float32")
    assert mc.tie_word_embeddings == (kind == "qwen2-tied")
    if kind == "qwen2-tied":
        assert mc.qkv_bias and not mc.o_bias and model.lm_head is model.embed
        assert model.layers[0].b_qkv is not None and model.layers[0].b_qkv.abs().sum() > 0
    if kind == "mistral":
        assert mc.architecture == "MistralForCausalLM" and mc.max_model_len == 128
    if kind == "llama-biases":
        assert mc.o_bias and mc.mlp_bias and model.layers[1].b_down is not None
    assert tok is not None and tok.convert_tokens_to_ids("w200") == 200
    ids = [5, 17, 200, 9, 3, 77, 42, 1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = _logits(model, ids)
    assert (out - ref).abs().max().item() < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_save_checkpoint_roundtrip_of_random_model(tmp_path: Path) -> None:
    loaded = load_model("random:tiny", tokenizer=False, seed=3, dtype="float32")
    save_checkpoint(loaded, tmp_path / "ckpt")
    again = load_model(tmp_path / "ckpt", tokenizer=False, dtype="float32")
    assert again.config == loaded.config
    ids = list(range(10, 30))
    assert torch.equal(_logits(again.model, ids), _logits(loaded.model, ids))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ref - _logits(loaded.model, ids)).abs().max().item() < 1e-4


def test_random_model_from_dict_and_dtype(tmp_path: Path) -> None:
    d = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8)
    model, tok, cfg = load_model(d, dtype="bf16")
    assert tok is None  # vocab smaller than the embedded tokenizer
    assert cfg == ModelConfig(**d) and model.embed.dtype == torch.bfloat16
    assert _logits(model, [1, 2, 3]).shape == (3, 100)


@pytest.mark.parametrize(("model", "match"), [
    ("no-such-model", "unknown model"),
    ("/definitely/missing/path", "unknown model"),
    ("random:gpt-9", "unknown model preset"),
])
def test_unknown_model_names_raise_value_error(model: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(model, tokenizer=False)


def test_non_llama_architecture_raises_value_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "n_embd": 64, "n_layer": 2, "n_head": 4}))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(empty)


def test_missing_tensor_and_bad_dtype_raise_value_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_checkpoint(load_model("random:tiny", tokenizer=False), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        load_model("random:tiny", dtype=torch.float16, tokenizer=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model("random:tiny", device="cuda", tokenizer=False)
    with pytest.raises(TypeError):
        load_model(42)  # type: ignore[arg-type]


def test_cache_root_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHUNKSERVE_CACHE", str(tmp_path / "cs"))
    assert cache_root() == tmp_path / "cs"
    monkeypatch.delenv("CHUNKSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "chunkserve"


# ---- the embedded SmolLM2 (slow: the first run converts the GGUF, ~20 s, into the user cache) ----

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def hf_gguf() -> tuple[torch.nn.Module, object]:
    gguf = embedded_gguf_path()
    kw = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32,
                                                 attn_implementation="eager", **kw).eval()
    return model, tok


@pytest.mark.slow
def test_embedded_smollm2_is_cached_and_matches_transformers_gguf(hf_gguf: tuple[torch.nn.Module, object]) -> None:
    ckpt = embedded_checkpoint_dir()
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    assert ckpt.parent.parent == cache_root()
    t0 = time.perf_counter()
    model, tok, cfg = load_model(dtype="float32")
    cached_s = time.perf_counter() - t0
    assert cached_s < 8.0, f"cached load took {cached_s:.1f}s"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (9, 3, 64, 30)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    hf, hf_tok = hf_gguf
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = _logits(model, ids)
    assert (out - ref).abs().max().item() < 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # the cache is a plain HF checkpoint: transformers loads it (fast) with the very same weights
    hf_cached = AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(hf_cached(torch.tensor([ids])).logits[0], ref)
