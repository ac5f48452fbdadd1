"""From a request's ``cache_control`` mark to the `PinSpec` a worker enforces (issue 16).

The last marked message (a mark on the message or on one of its text parts) pins the prompt up to the
end of that message: the chat template applied to the messages up to it, without the generation
prompt, gives its token count (the longest common prefix with the full prompt, so a template that
renders a message differently when it is last never pins tokens the prompt does not have). The TTL
must be one the tenant allows (else 400 naming the field); the quota and the pool share are checked
by the worker that holds the pin (`workers/pins.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from chunkserve.router.openai_api import APIError, ChatCompletionRequest, CompletionRequest, template_chars
from chunkserve.router.tenants import Tenant
from chunkserve.workers.cache_control import TTL_SECONDS, PinSpec

_THREAD_CHARS = 4096


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


async def cache_pin_spec(tenant: Tenant, req: CompletionRequest | ChatCompletionRequest, ids: list[int],
                         encode_prefix: Callable[[list[dict[str, str]]], list[int]]) -> PinSpec | None:
    """The request's pin, or None when it marks nothing. Raises APIError 400 for a TTL the tenant may not use."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    found = req.cache_mark()
    if found is None:
        return None
    index, mark = found
    pins = tenant.cache_pins
    if mark.ttl not in pins.allowed_ttls:
        raise APIError(400, f"cache_control ttl {mark.ttl!r} is not allowed for this tenant "
                            f"(allowed: {', '.join(pins.allowed_ttls) or 'none'})",
                       param=f"messages.{index}.cache_control.ttl", code="invalid_value")
    msgs = req.template_messages()[:index + 1]
    try:
        if template_chars(msgs) > _THREAD_CHARS:
            head = await asyncio.to_thread(encode_prefix, msgs)
        else:
            head = encode_prefix(msgs)
    except Exception as e:  # e.g. a chat template that rejects a conversation ending on this message
        raise APIError(400, f"could not tokenize the messages up to the cache_control mark: {e}",
                       param=f"messages.{index}.cache_control", code="invalid_value") from None
    n = common_prefix(head, ids)
    if n < 1:
        return None
    return PinSpec(num_tokens=n, ttl_s=TTL_SECONDS[mark.ttl], quota_tokens=pins.max_pinned_tokens,
                   on_pool_full=pins.on_pool_full)
