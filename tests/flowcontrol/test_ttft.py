"""The engine part of a request's predicted TTFT: the best pod's learned model at its state now."""

from __future__ import annotations

import pytest

from extproc.accounting.latency_model import LatencyModels
from extproc.flowcontrol import FlowRequest
from extproc.flowcontrol.ttft import EngineTtft
from extproc.routing.predicted import LatencyFeatures
from extproc.types import Endpoint, EngineMetrics

A = Endpoint(address="10.0.0.1:8000", model="m")
B = Endpoint(address="10.0.0.2:8000", model="m")
READY = [
    (A, EngineMetrics(updated_at=0.0, running=2.0, waiting=0.0, kv_cache_usage=0.2)),
    (B, EngineMetrics(updated_at=0.0, running=2.0, waiting=0.0, kv_cache_usage=0.2)),
]


def teach(models: LatencyModels, address: str, per_ktoken: float) -> None:
    """A pod whose TTFT is 20 ms + `per_ktoken` per 1,000 uncached tokens."""
    for i in range(40):
        tokens = 100 * (i % 10 + 1)
        features = LatencyFeatures(tokens, i % 3, 500 * (i % 3), 0.0, 2.0, 0.2)
        models.observe("m", address, features, ttft_s=0.02 + per_ktoken * tokens / 1000,
                       tpot_s=None)  # fmt: skip


def estimate(models: LatencyModels, prompt_tokens: int) -> float | None:
    ttft = EngineTtft(ready=lambda _m: READY, load=lambda _a: (1, 500), models=models)
    return ttft(FlowRequest(model="m", priority=0, flow="", size=1, prompt_tokens=prompt_tokens))


def test_cold_models_know_nothing() -> None:
    assert estimate(LatencyModels(), 1000) is None


def test_the_best_pod_at_its_state_now() -> None:
    models = LatencyModels()
    teach(models, A.address, per_ktoken=0.2)
    teach(models, B.address, per_ktoken=0.05)  # B prefills 4x faster
    assert estimate(models, 1000) == pytest.approx(0.07, abs=0.01)
    assert estimate(models, 4000) == pytest.approx(0.22, abs=0.02)
