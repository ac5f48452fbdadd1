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
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stops = params.stop
        self.ids: list[int] = []
        self.emitted = 0  # chars of the full text already emitted
        self.text = ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string ended the output)."""
        self.ids.append(token_id)
        self.text = self._decode()
        if self.stops:
            hits = [(self.text.find(s, max(0, self.emitted - len(s))), s) for s in self.stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                self.text = self.text[:cut]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out, True
        if final:
            return self.flush(), False
        end = len(self.text)
        if self.text.endswith("\ufffd"):
            end = self.text.rfind("\ufffd")
            while end > 0 and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(self.emitted, end - self._hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
