"""The scheduler's records: a request and its progress (`Request`), and what one step runs (`StepPlan`).

Torch-free; `scheduler.py` fills them, the runner and the engine read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress (compared and hashed by identity: one object per request)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    salt: bytes = b""
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_id: int | None = None
    num_cached: int | None = None  # prompt tokens served from the cache at first admission (None: not yet)
    num_computed: int = 0  # tokens of prompt+output whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    order: int = 0  # admission order
    first_token_time: float | None = None
    tenant: str = "public"
    weight: float = 1.0  # fair-share weight of the tenant
    pin: PinSpec | None = None  # cache_control: pin the prompt's first pin.num_tokens tokens
    seq: tuple[float, int] = (0.0, -1)  # queue order: (arrival, add order), kept across preemptions
    admit_time: float | None = None  # first admission (monotonic)
    pinned_tokens: int = 0  # tokens pinned (or renewed) for this request
    cache_creation_tokens: int = 0  # pinned prefix tokens this request computed (not read from the cache)
    overtaken: int = 0  # prompt tokens of its tenant's later arrivals planned before it (fair share's aging bound)
    remaining_at: tuple[int, int] = (-1, 0)  # (scheduler step, prompt tokens left) while waiting: a match memo
    handed_wall: float | None = None  # served engines: wall clock when the worker handed it over, and when the
    intake_wall: float | None = None  # engine thread took it (`FirstTokenTimeline`)
    _prompt_np: np.ndarray | None = field(default=None, repr=False)

    def prompt_array(self) -> np.ndarray:
        """The prompt as an int64 array (built once: matching a waiting request against the cache each step)."""
        if self._prompt_np is None:
            self._prompt_np = np.asarray(self.prompt, dtype=np.int64)
        return self._prompt_np

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def sid(self) -> int:
        """The cache sequence of an admitted request (RuntimeError before admission or after release)."""
        if self.seq_id is None:
            raise RuntimeError(f"request {self.request_id!r} holds no cache sequence")
        return self.seq_id

    @property
    def prefill_len(self) -> int:
        """Tokens whose K/V its (re)prefill computes: the prompt, after a preemption also the output but its last."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    def chunks_alone(self, chunk_size: int) -> int:
        """KV chunks its (re)prefill and first decode slot take with nothing cached: what it needs of the pool."""
        return -(-(self.prefill_len + 1 + bool(self.output)) // chunk_size)

    @property
    def prefilling(self) -> bool:
        """Still before its first sampled token, or recomputing after a preemption."""
        return not self.output or self.num_computed < self.prefill_len


@dataclass(frozen=True)
class PrefillPiece:
    req: Request
    start: int  # position of the first new token
    tokens: list[int]
    samples: bool  # this piece ends the prompt: sample the next token from its last row
    write: bool = True  # False: a fully cached prompt's last token, run for its logits only (its K/V are cached)


@dataclass
class StepPlan:
    prefills: list[PrefillPiece] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # in tree order (decode_ctx rows)
    decode_ctx: object | None = None  # ChunkContext of the decode rows
    slot_chunks: list[int] = field(default_factory=list)  # per new token, in batch row order
    slot_offsets: list[int] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler: its context outgrew the pool

    @property
    def num_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.prefills) + len(self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes
