"""The offline API: `LLM.generate` / `LLM.chat` over the engine, without Ray.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct on CPU
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str
    logprobs: list[float] | None = None


class LLM:
    """Offline batched generation with prefix sharing (see `EngineConfig` for the options)."""

    def __init__(self, model: Any = None, chunk_size: int = 64, share_prefix: bool = True,
                 attention_backend: str = "auto", **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, chunk_size=chunk_size, share_prefix=share_prefix,
                                   attention_backend=attention_backend, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token id lists")
            _check_text(prompt, "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise TypeError("each prompt must be a str or a list of token ids")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
            _check_text(m["content"], f"messages[{i}].content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 salt: bytes = b"") -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self._tokenize(p) for p in prompts]
        return self._run(token_lists, sampling_params, salt)

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             salt: bytes = b"") -> list[RequestOutput]:
        """Generate a reply for each OpenAI-style message list, using the model's chat template."""
        one = bool(conversations) and isinstance(conversations[0], dict)
        convs = cast(list[list[dict[str, str]]], [conversations] if one else conversations)
        return self._run([self.apply_chat_template(c) for c in convs], sampling_params, salt)

    def _run(self, token_lists: list[list[int]], params: SamplingParams | list[SamplingParams] | None,
             salt: bytes) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(token_lists)
        if len(plist) != len(token_lists):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        texts: dict[str, list[str]] = {i: [] for i in ids}
        done: dict[str, Any] = {}
        added: list[str] = []
        try:
            for rid, toks, p in zip(ids, token_lists, plist, strict=True):
                self.engine.add_request(rid, toks, p, salt)
                added.append(rid)
            while len(done) < len(ids):
                if not self.engine.has_work():
                    raise RuntimeError("engine stopped with unfinished requests")
                for out in self.engine.step():
                    rid = out.req.request_id
                    texts[rid].append(out.text)
                    if out.finish_reason is not None:
                        done[rid] = out
        finally:
            for rid in added:
                if rid not in done:
                    self.engine.abort(rid)
        results = []
        for rid, toks in zip(ids, token_lists, strict=True):
            req = done[rid].req
            results.append(RequestOutput(rid, "".join(texts[rid]), list(req.output), toks, req.num_cached or 0,
                                         req.finish_reason, list(req.logprobs) if req.params.logprobs else None))
        return results

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


def _check_text(text: str, name: str) -> None:
    """Refuses text that UTF-8 cannot encode (a lone surrogate), which the tokenizer fails on with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: {e.reason} at position {e.start}") from None
