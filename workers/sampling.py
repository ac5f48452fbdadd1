"""Sampling parameters and the per-step sampler."""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError at construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    # Draws of the seeded generator already used: a stream resumed after a failover (prompt + the tokens
    # already sent) continues the seeded sequence instead of restarting it.
    seed_offset: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = () if isinstance(self.stop_token_ids, str | bytes) else tuple(self.stop_token_ids or ())
        if isinstance(self.stop_token_ids, str | bytes) or any(not is_integer(t) or int(t) < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not is_integer(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", operator.index(self.seed))
        if not is_integer(self.seed_offset) or self.seed_offset < 0:
            raise ValueError(f"seed_offset must be an integer >= 0, got {self.seed_offset!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def is_integer(x: object) -> bool:
    """An integer of any kind (Python, NumPy, a 0-d integer tensor) that is not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def is_real(x: object) -> bool:
    """A real number that is not a bool (NaN fails the range checks that follow)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
