"""The offline engine's input checks: a bad parameter is refused, naming it, before anything is queued, so it
neither fails a later step (which drops every request and empties the prefix cache) nor hurts other prompts."""

from __future__ import annotations

from typing import Any

import pytest

from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.llm import LLM
from chunkserve.workers.protocol import InvalidRequestError
from chunkserve.workers.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(3, 67))  # one 64-token chunk


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="random:tiny", dtype="float32", chunk_size=16, num_kv_chunks=64, warmup=False)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"seed": 0.5}, "seed"), ({"seed": True}, "seed"), ({"temperature": "0.7"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": "0.9"}, "top_p"), ({"top_k": True}, "top_k"),
    ({"stop": [1]}, "stop"), ({"stop": ["a", ""]}, "stop"), ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"max_tokens": 2.0}, "max_tokens"),
])
def test_sampling_params_of_the_wrong_type_are_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": -5}, "max_model_len"),
    ({"num_kv_chunks": 0}, "num_kv_chunks"), ({"kv_cache_gb": float("nan")}, "kv_cache_gb"),
    ({"chunk_size": 16.0}, "chunk_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_engine_config_values_that_were_replaced_or_crashed_later_are_refused(kwargs: dict[str, Any],
                                                                             field: str) -> None:
    """max_model_len 0 and num_kv_chunks 0 silently became the model's context and a 2 GB pool."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="random:tiny", **kwargs)


@pytest.mark.parametrize(("args", "match"), [
    ({"params": {"max_tokens": 3}}, "SamplingParams"),
    ({"salt": "tenant-a"}, "salt"),
    ({"prompt": [1.5, 2.0]}, "integers"),
    ({"prompt": [True, 2]}, "integers"),
])
def test_a_request_refused_at_add_leaves_no_trace_and_the_prefix_cache_keeps_its_chunks(llm: LLM, args, match):
    """Such a request used to be queued (or half-registered) and fail inside the next step, which aborted the
    other requests and emptied the cache; the next valid call then failed too (an orphan's KeyError)."""
    llm.generate([SYSTEM + [70]], GREEDY)
    bad = llm.engine
    with pytest.raises(InvalidRequestError, match=match):
        bad.add_request("bad", args.get("prompt", SYSTEM + [71]), args.get("params", GREEDY), args.get("salt", b""))
    assert not bad.has_work()
    out = llm.generate([SYSTEM + [72]], GREEDY)[0]
    assert out.num_cached_tokens >= 64 and len(out.token_ids) == 4


@pytest.mark.parametrize(("call", "match"), [
    (lambda m: m.generate("\ud800abc"), "prompt is not valid Unicode"),
    (lambda m: m.generate([[True, 2]]), "token ids"),
    (lambda m: m.chat([{"role": "user"}]), r"messages\[0\]"),
    (lambda m: m.chat([{"role": "user", "content": None}]), r"messages\[0\]"),
    (lambda m: m.chat([{"role": "user", "content": "hi \udfff"}]), r"messages\[0\].content"),
])
def test_texts_and_messages_the_tokenizer_cannot_take_are_refused_by_name(llm: LLM, call, match) -> None:
    """These failed inside the tokenizer or the chat template (TypeError, jinja's UndefinedError)."""
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        pytest.skip("random:tiny has no tokenizer with a chat template here")
    with pytest.raises((ValueError, TypeError), match=match):
        call(llm)


def test_the_engine_configs_torch_free_choice_lists_match_the_kernels_and_the_loader() -> None:
    """EngineConfig checks backends and dtypes without torch (the ingress validates it); the lists must agree."""
    from chunkserve.kernels.api import BACKENDS
    from chunkserve.kernels.prefill import PREFILL_BACKENDS
    from chunkserve.workers import engine_config
    from chunkserve.workers.weights import resolve_dtype

    assert engine_config.ATTENTION_BACKENDS == BACKENDS and engine_config.PREFILL_BACKENDS == PREFILL_BACKENDS
    for name in engine_config.DTYPE_NAMES:
        if name not in ("float16", "fp16", "half"):  # not on a CPU
            resolve_dtype(name, "cpu")
