"""The TTFT a request would see once it has room: what flow control weighs against a request's
TTFT SLO, besides its wait in the queue.

It is the lowest of the ready pods' predictions by their predicted-latency models (learned online
from every streamed answer, `extproc.accounting.latency_model`) at their state now, with nothing
waiting ahead of it and none of its prompt cached (the prefix a pod holds is only known when the
request is routed: the estimate errs long, so refusals err on the side of serving). None while
every pod's model is cold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from extproc.flowcontrol.controller import FlowRequest
from extproc.routing.predicted import LatencyFeatures, LatencyPredictor
from extproc.types import Endpoint, EngineMetrics

__all__ = ["EngineTtft"]


class EngineTtft:
    """`estimate(request)`: seconds, or None when no pod's model is warm."""

    def __init__(
        self,
        *,
        ready: Callable[[str], Sequence[tuple[Endpoint, EngineMetrics]]],
        load: Callable[[str], tuple[int, int]],  # address -> (requests, tokens) in flight
        models: LatencyPredictor,
    ) -> None:
        self._ready = ready
        self._load = load
        self._models = models

    def __call__(self, request: FlowRequest) -> float | None:
        best: float | None = None
        for ep, m in self._ready(request.model):
            requests, tokens = self._load(ep.address)
            kv = m.kv_cache_usage if m.kv_cache_usage is not None else 0.0
            features = LatencyFeatures(
                uncached_tokens=max(0, request.prompt_tokens),
                in_flight=requests,
                in_flight_tokens=tokens,
                waiting=0.0,
                running=m.running if m.running is not None else 0.0,
                kv_usage=min(1.0, max(0.0, kv)),
            )
            pred = self._models.predict(request.model, ep.address, features)
            if pred is not None and (best is None or pred.ttft_s < best):
                best = pred.ttft_s
        return best
