"""Step outputs and incremental detokenisation with stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkserve.workers.sampling import SamplingParams


@dataclass
class StepOutput:
    """What one step produced for one request."""

    req: Any  # scheduler.Request
    token_ids: list[int]
    text: str  # newly emitted text
    finish_reason: str | None
    logprobs: list[float] | None = None


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Text that could be the start of a stop string, or an incomplete UTF-8 sequence, is held back
    until it is settled; a stop string ends the request and is not emitted.

    Incremental (like vLLM / TGI): each token decodes only a small window ``ids[prefix_offset:]``;
    its text past ``decode(ids[prefix_offset:read_offset])`` is new, and once it does not end in
    U+FFFD (an incomplete UTF-8 sequence) it is settled and both offsets move up. Only the unemitted
    text, plus as many emitted characters as the longest stop string (a stop may start there), is
    kept, so the work per token does not grow with the output's length. The deltas concatenate to
    ``tokenizer.decode(ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stops = params.stop
        self.ids: list[int] = []
        self.emitted = 0  # chars of the full text already emitted
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self._hold = max(self._max_stop, 1) - 1
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to `_prefix_len` chars of context
        self._read_offset = 0
        self._prefix_len = 0
        self._base = 0  # full-text index of _settled[0]
        self._settled = ""  # settled text from _base on (the full text's settled part ends here)
        self._pending = ""  # decoded text past the settled part that may still change (ends in U+FFFD)
        self._stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self) -> None:
        """Decode the window for the newest token; settle its text unless it ends mid-character."""
        new_text = self._decode(self.ids[self._prefix_offset:])
        if len(new_text) > self._prefix_len and not new_text.endswith("\ufffd"):
            self._settled += new_text[self._prefix_len:]
            self._pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._prefix_len = len(self._decode(self.ids[self._prefix_offset:self._read_offset]))
        else:
            self._pending = new_text[self._prefix_len:]

    def add(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string ended the output)."""
        self.ids.append(token_id)
        self._advance()
        text = self._settled + self._pending  # the full text from _base on
        done = self.emitted - self._base  # chars of `text` already emitted
        if self.stops:
            hits = [(text.find(s, max(0, done - len(s))), s) for s in self.stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                out = text[done:cut]
                self._settled, self._pending, self._stopped = text[:cut], "", True
                self.emitted = self._base + max(done, cut)
                return out, True
        if final:
            return self.flush(), False
        end = len(text)
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        end = max(done, end - self._hold)
        out = text[done:end]
        self.emitted = self._base + end
        # keep the unemitted text and the last _max_stop emitted chars (where a stop string may start)
        drop = min(end - self._max_stop, len(self._settled))
        if drop > 0:
            self._settled = self._settled[drop:]
            self._base += drop
        return out, False

    def flush(self) -> str:
        """Everything not yet emitted (after a stop: nothing)."""
        if self._stopped:
            return ""
        text = self._settled + self._pending
        out = text[self.emitted - self._base:]
        self.emitted = self._base + len(text)
        return out
