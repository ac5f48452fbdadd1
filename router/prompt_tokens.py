"""Chat prompts tokenised once per shared head: the ids of a conversation's leading messages are kept and reused.

Many tenants' chats differ only in their last message, after a long shared system prompt, and tokenising
~1,000 tokens of it costs the ingress 2-3 ms of CPU a request (its event loop's largest cost in a burst).
`ChatTokenCache.encode_chat` renders the chat template, splits the text right after the last special token of
the head (the conversation without its last message, as the template renders it), takes the head's ids from
a bounded LRU, and tokenises only the rest. The result is the same list of ids as tokenising the whole text:

- a fast tokenizer extracts its added tokens before normalising and pre-tokenising, so the text on either
  side of one is tokenised on its own; the split token must neither strip the whitespace beside it
  (``lstrip`` / ``rstrip``), nor match whole words only, nor lie inside or overlap another added token;
- the rest is tokenised behind the split token (``token + rest``, its first id dropped), so a pre-tokenizer
  that treats the first section of a text apart (``Metaspace`` with ``prepend_scheme="first"``) sees it as a
  later section, as in the whole text;
- both halves are checked to end and start with the split token's id; anything else (a template that renders
  the head differently, a slow tokenizer, no special token in the head) tokenises the whole text.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["ChatTokenCache"]

MIN_HEAD_CHARS = 256  # shorter heads are tokenised with the rest: a lookup would save nothing


def _split_tokens(tokenizer: Any) -> dict[str, int]:
    """The special tokens the text may be split after: {content: id}."""
    if not getattr(tokenizer, "is_fast", False):
        return {}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    contents = [t.content for t in added.values() if t.content]
    # who has each non-empty prefix, and each proper suffix (a few hundred reserved tokens: no pairwise scan)
    prefixes: dict[str, set[str]] = {}
    suffixes: dict[str, set[str]] = {}
    for c in contents:
        for k in range(1, len(c) + 1):
            prefixes.setdefault(c[:k], set()).add(c)
        for i in range(1, len(c)):
            suffixes.setdefault(c[i:], set()).add(c)
    out: dict[str, int] = {}
    for tid, tok in added.items():
        s = tok.content
        if not tok.special or tok.lstrip or tok.rstrip or tok.single_word or tok.normalized or not s:
            continue
        if any(s in other and s != other for other in contents) or _overlaps(s, prefixes, suffixes):
            continue
        out[s] = int(tid)
    return out


def _overlaps(s: str, prefixes: dict[str, set[str]], suffixes: dict[str, set[str]]) -> bool:
    """Whether another added token begins inside ``s`` (a proper suffix of ``s`` is its prefix) or ends inside it
    (a proper suffix of it is a prefix of ``s``): then where one ends the other may begin."""
    return (any(prefixes.get(s[i:], set()) - {s} for i in range(1, len(s)))
            or any(suffixes.get(s[:k], set()) - {s} for k in range(1, len(s) + 1)))


class ChatTokenCache:
    """The chat template's token ids for a conversation, its head's ids from a bounded LRU (thread-safe)."""

    def __init__(self, tokenizer: Any, max_entries: int = 256, max_chars: int = 16 << 20) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._split = _split_tokens(tokenizer)
        self._pattern = (re.compile("|".join(re.escape(s) for s in sorted(self._split, key=len, reverse=True)))
                         if self._split else None)
        self._heads: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._pattern is not None and self.max_entries > 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """``encode(apply_chat_template(messages, add_generation_prompt=True))`` without special tokens added."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not self.enabled or len(messages) < 2 or len(text) < MIN_HEAD_CHARS:  # a short chat: one render
            return self._encode(text)
        try:
            head = self.tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=False)
        except Exception:  # a template that refuses a conversation ending on this message
            return self._encode(text)
        if not isinstance(head, str) or not text.startswith(head):
            return self._encode(text)
        return self._encode_split(text, head)

    def encode_prefix(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of ``messages`` rendered without the generation prompt (a ``cache_control`` mark's prefix):
        the head of the chats that continue them, so usually found in the cache."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return self._encode_split(text, text) if self.enabled else self._encode(text)

    def _encode_split(self, text: str, head: str) -> list[int]:
        """``text``'s ids, split after the last split token inside ``head`` (a prefix of it) when there is one."""
        found = list(self._pattern.finditer(head)) if self._pattern is not None else []
        if not found or found[-1].end() < MIN_HEAD_CHARS:
            return self._encode(text)
        pos, token = found[-1].end(), found[-1].group(0)
        tid = self._split[token]
        ids = self._head_ids(text[:pos], tid)
        rest = self._encode(token + text[pos:])
        if ids is None or not rest or rest[0] != tid:
            return self._encode(text)
        return [*ids, *rest[1:]]

    def _head_ids(self, head_text: str, tid: int) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._heads.get(head_text)
            if ids is not None:
                self._heads.move_to_end(head_text)
                self.hits += 1
                return ids
            self.misses += 1
        ids = tuple(self._encode(head_text))
        if not ids or ids[-1] != tid:
            return None
        with self._lock:
            if head_text not in self._heads:
                self._heads[head_text] = ids
                self._chars += len(head_text)
            while self._heads and (len(self._heads) > self.max_entries or self._chars > self.max_chars):
                old, _ = self._heads.popitem(last=False)
                self._chars -= len(old)
        return ids
