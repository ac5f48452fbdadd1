"""Where the ingress tokenises: long inputs in a worker thread, off the event loop that serves every stream."""

from __future__ import annotations

import asyncio
import threading

from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.openai_api import ChatCompletionRequest, template_chars
from chunkserve.router.tenants import TenantRegistry
from chunkserve.workers.weights import load_model


def _threads_used(n_messages: int) -> tuple[list[str], list[int]]:
    ing = Ingress(None, load_model("random:tiny").tokenizer, TenantRegistry(None),  # type: ignore[arg-type]
                  IngressConfig(model_name="m", max_model_len=100_000, chunk_size=16))
    seen: list[str] = []
    encode = ing._encode_chat

    def spy(msgs):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return encode(msgs)

    ing._encode_chat = spy  # type: ignore[method-assign]
    roles = ["user", "assistant"]
    req = ChatCompletionRequest(model="m", messages=[{"role": roles[i % 2], "content": "ok"}
                                                     for i in range(n_messages)])
    ids = asyncio.run(ing.tokenize(req))
    return seen, ids


def test_many_short_messages_are_tokenised_off_the_event_loop_like_one_long_text():
    seen, ids = _threads_used(400)  # 800 characters of content, ~13,600 once the template wraps each message
    assert seen and seen[0] != threading.main_thread().name and len(ids) > 400
    seen, _ = _threads_used(2)
    assert seen == [threading.main_thread().name]  # a short chat stays inline (a thread hop costs more)


def test_template_chars_counts_each_messages_markup():
    assert template_chars([{"role": "user", "content": ""}] * 3) == 3 * template_chars([{"role": "user", "content": ""}])
    assert template_chars([{"role": "user", "content": "abcd"}]) == 4 + template_chars([{"role": "user", "content": ""}])
    assert template_chars([{"role": "user", "content": ""}]) > 0


def test_chats_that_share_a_system_prompt_have_it_tokenised_once() -> None:
    tok = load_model("random:tiny").tokenizer
    ing = Ingress(None, tok, TenantRegistry(None),  # type: ignore[arg-type]
                  IngressConfig(model_name="m", max_model_len=100_000, chunk_size=16))
    system = "You are the support assistant of Acme. Cite the policy number in every answer. " * 12
    ids = []
    for question in ("Where is my order?", " Can I get a refund?\n"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids.append(asyncio.run(ing.tokenize(ChatCompletionRequest(model="m", messages=msgs))))
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ids[-1] == list(tok.encode(text, add_special_tokens=False))
    assert (ing.chat_tokens.misses, ing.chat_tokens.hits) == (1, 1)
