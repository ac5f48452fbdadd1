"""OpenAI request models, validation errors, response bodies and server metrics (pure, no server)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    openai_finish_reason,
    parse_request,
    sse,
    usage_body,
)
from chunkserve.router.server_metrics import ServerMetrics

LIMIT = 1 << 20


def _chat(**over) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(over)
    return json.dumps(body).encode()


def _err(body: bytes, cls=ChatCompletionRequest, limit: int = LIMIT) -> APIError:
    with pytest.raises(APIError) as ei:
        parse_request(body, cls, limit)
    return ei.value


def test_valid_chat_request_parses_with_all_parameters():
    req = parse_request(_chat(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3,
                              stop=["x", "y"], seed=42, n=1, user="u", stream=True, ignore_eos=True,
                              stream_options={"include_usage": True}), ChatCompletionRequest, LIMIT)
    assert req.requested_max_tokens() == 7 and req.temperature == 0.0 and req.top_k == 3 and req.ignore_eos
    assert req.stop_list() == ("x", "y") and req.include_usage and req.seed == 42


def test_content_parts_and_developer_role_are_flattened_for_the_template():
    req = parse_request(_chat(messages=[{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]),
                        ChatCompletionRequest, LIMIT)
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'"text"', None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (_chat(messages=[]), "messages"),
    (_chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (_chat(messages=[{"role": "user"}]), "messages"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages"),
    (_chat(model=3), "model"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_tokens=-5), "max_tokens"),
    (_chat(max_tokens="5"), "max_tokens"),
    (_chat(max_tokens=2.5), "max_tokens"),
    (_chat(max_completion_tokens=0), "max_completion_tokens"),
    (_chat(temperature=-0.1), "temperature"),
    (_chat(temperature=2.5), "temperature"),
    (_chat(temperature="hot"), "temperature"),
    (_chat(top_p=0), "top_p"),
    (_chat(top_k=-2), "top_k"),
    (_chat(n=2), "n"),
    (_chat(n=0), "n"),
    (_chat(stop=[""]), "stop"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_chat(seed=2**70), "seed"),
    (_chat(stream="yes"), "stream"),
    (_chat(ignore_eos="yes"), "ignore_eos"),
    (_chat(ignore_eos=1), "ignore_eos"),
    (_chat(logprobs=True), "logprobs"),
    (_chat(presence_penalty=0.5), "presence_penalty"),
    (_chat(unknown_field=1), "unknown_field"),
])
def test_bad_chat_bodies_are_400_with_openai_error_json(body, param):
    e = _err(body)
    assert e.status == 400
    err = e.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_n_other_than_one_names_n_in_the_message():
    assert "n=1" in _err(_chat(n=3)).message


def test_body_over_the_limit_is_413():
    e = _err(_chat(messages=[{"role": "user", "content": "x" * 2000}]), limit=1000)
    assert e.status == 413


@pytest.mark.parametrize("prompt,ok", [
    ("hello", True), ([1, 2, 3], True), (["hello"], True), ([[1, 2]], True),
    ("", False), ([], False), (["a", "b"], False), ([[1], [2]], False), ([-1], False), ([1.5], False),
    (None, False), ({"a": 1}, False),
])
def test_completion_prompt_forms(prompt, ok):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    if ok:
        req = parse_request(body, CompletionRequest, LIMIT)
        assert req.prompt in ("hello", [1, 2, 3], [1, 2])
    else:
        assert _err(body, CompletionRequest).status == 400


def test_completion_rejects_unsupported_options():
    for extra in ({"echo": True}, {"best_of": 2}, {"logprobs": 2}, {"suffix": "x"}):
        body = json.dumps({"model": "m", "prompt": "p", **extra}).encode()
        assert _err(body, CompletionRequest).param == next(iter(extra))


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
                    max_leaves=20))
def test_any_json_value_either_parses_or_is_a_4xx(value):
    body = json.dumps(value).encode()
    for cls in (ChatCompletionRequest, CompletionRequest):
        try:
            parse_request(body, cls, LIMIT)
        except APIError as e:
            assert 400 <= e.status < 500


def test_response_bodies_have_the_openai_shape():
    usage = usage_body(10, 3, 8, 2)
    assert usage == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                     "prompt_tokens_details": {"cached_tokens": 8, "cache_creation_tokens": 2}}
    r = chat_response("id1", "m", 1, "hey", "length", usage)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"] is usage
    last = chat_chunk("id1", "m", 1, None, usage=usage)
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert openai_finish_reason("stop") == "stop" and openai_finish_reason(None) is None
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse({"a": 1})[6:]) == {"a": 1}


def test_server_metrics_use_the_chunkserve_prefix_and_own_registry():
    m1, m2 = ServerMetrics("tiny"), ServerMetrics("tiny")  # two registries: no duplicate-name clash
    m1.request_waiting("acme")
    m1.first_token("acme", 0.05, prompt_tokens=100, cached_tokens=64)
    m1.request_done("acme", True, e2e_s=0.5, decode_s=0.45, output_tokens=10, finish_reason="length")
    m1.set_kv_usage(0.25)
    m1.error(429)
    text = m1.render().decode()
    for name in ("chunkserve:prefix_cache_queries_total", "chunkserve:prefix_cache_hits_total",
                 "chunkserve:num_requests_running", "chunkserve:num_requests_waiting",
                 "chunkserve:time_to_first_token_seconds_bucket",
                 "chunkserve:time_per_output_token_seconds_bucket",
                 "chunkserve:e2e_request_latency_seconds_bucket", "chunkserve:kv_cache_usage_perc"):
        assert name in text, name
    assert 'chunkserve:prefix_cache_hits_total{model_name="tiny",tenant="acme"} 64.0' in text
    assert 'chunkserve:num_requests_running{model_name="tiny",tenant="acme"} 0.0' in text
    assert 'chunkserve:request_errors_total{code="429",model_name="tiny"} 1.0' in text
    assert "acme" not in m2.render().decode()
