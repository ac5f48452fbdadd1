"""Failover helpers of the ingress: the request that resumes a stream on another worker, and its text.

A stream resumed after its worker died continues from the prompt plus the tokens already sent
(`resume_request`). Its deltas are counted as the original request's (`rebased`), and its text comes from
`ResumedText`: the ingress's own decode of all the output tokens, diffed against the text the client already
has, so that a character split across the failover (an incomplete UTF-8 sequence held back by the first
worker) and a stop string spanning it come out exactly as in an undisturbed run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from chunkserve.workers.protocol import GenerateDelta, GenerateRequest


def resume_request(req: GenerateRequest, sent: Sequence[int], attempt: int) -> GenerateRequest:
    """The request that continues ``req`` on another worker after ``sent`` tokens reached the client: the
    prompt plus those tokens, the remaining budget, and a seeded sampler advanced past the draws made."""
    s = req.sampling
    sampling = dataclasses.replace(s, max_tokens=s.max_tokens - len(sent), seed_offset=s.seed_offset + len(sent))
    return dataclasses.replace(req, request_id=f"{req.request_id}-f{attempt}",
                               prompt_token_ids=tuple(req.prompt_token_ids) + tuple(sent), sampling=sampling)


def rebased(d: GenerateDelta, n_prompt: int, n_sent: int, n_cached: int, text: str,
            finish_reason: str | None) -> GenerateDelta:
    """A delta of a resumed request, counted as the original request (its prompt, all its output)."""
    return dataclasses.replace(d, num_prompt_tokens=n_prompt, num_cached_tokens=n_cached,
                               num_output_tokens=d.num_output_tokens + n_sent, first_token_time=None,
                               text=text, finish_reason=finish_reason)


class ResumedText:
    """The text deltas of a resumed stream: ``decode(all output ids)`` past what the client already got,
    holding back a trailing incomplete character and what may start a stop string until settled."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], emitted: str, output_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.emitted = emitted
        self.ids = list(output_ids)
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string ended the output)."""
        self.ids.extend(token_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = len(self.emitted)
        cuts = [i for s in self.stops if (i := full.find(s, max(0, start - len(s) + 1))) >= 0]
        if cuts:
            text = full[start:max(start, min(cuts))]
            self.emitted += text
            return text, True
        end = len(full)
        if not final:
            while end > start and full[end - 1] == "\ufffd":
                end -= 1
            end = max(start, end - self._hold)
        text = full[start:end]
        self.emitted += text
        return text, False
