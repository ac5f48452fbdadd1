"""Where time to first token goes: the served engine stamps each request's way to its first token, the ingress
adds its own stamps and exports the legs as `chunkserve:ttft_leg_seconds`."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.router.local_server import local_ingress
from chunkserve.router.openai_api import CompletionRequest
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import TTFT_LEGS, FirstTokenTimeline


def test_legs_are_the_gaps_between_consecutive_stamps_and_never_negative() -> None:
    t = FirstTokenTimeline(worker_s=10.010, intake_s=10.012, admitted_s=10.012, first_token_s=10.050)
    legs = t.legs(received_s=10.000, called_s=10.004, returned_s=10.049)  # a host whose clock runs 1 ms behind
    assert list(legs) == list(TTFT_LEGS)
    assert legs["ingress"] == pytest.approx(0.004) and legs["route"] == pytest.approx(0.006)
    assert legs["step_wait"] == pytest.approx(0.002) and legs["admission"] == 0.0
    assert legs["prefill"] == pytest.approx(0.038) and legs["return"] == 0.0


def _leg_counts_and_sums(text: str) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "chunkserve:ttft_leg_seconds":
            continue
        for s in fam.samples:
            leg = s.labels.get("leg")
            if s.name.endswith("_count"):
                out.setdefault(leg, [0.0, 0.0])[0] = s.value
            elif s.name.endswith("_sum"):
                out.setdefault(leg, [0.0, 0.0])[1] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_a_served_request_reports_every_leg_of_its_time_to_first_token_once() -> None:
    async def main() -> tuple[dict[str, tuple[float, float]], float]:
        cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=64, max_model_len=256, num_threads=1)
        ingress = local_ingress(cfg, model_name="tiny-legs")
        try:
            req = CompletionRequest(model="tiny-legs", prompt=[5, 6, 7, 8, 9] * 8, max_tokens=4, temperature=0.0)
            received = time.time()
            prep = await ingress.prepare(ingress.authenticate(None), req, "cmpl-legs", received)
            first = None
            async for d in ingress.stream(prep):
                if first is None and d.token_ids:
                    first = time.time() - received
            assert first is not None
            return _leg_counts_and_sums(ingress.metrics.render().decode()), first
        finally:
            await asyncio.to_thread(ingress.engine.engine.shutdown)

    legs, ttft = asyncio.run(main())
    assert set(legs) == set(TTFT_LEGS)
    assert all(count == 1 for count, _ in legs.values()), legs
    total = sum(total for _, total in legs.values())
    assert 0 < total <= ttft + 1e-3, (total, ttft)  # the legs tile the way from receipt to the first token
    assert legs["prefill"][1] > 0  # the engine computed the prompt
