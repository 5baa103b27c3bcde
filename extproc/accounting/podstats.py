"""What the gateway measures about each pod itself: throughput, busy time, latencies.

AIBrix's `least-busy-time` and `throughput` read signals vLLM does not export; we derive
them from what the gateway sees: busy time from its own in-flight requests (start and end of
the routing stream), tokens and latencies from each response's access-log record.

Rates and busy time are continuous-time exponential averages with time constant `tau`
(seconds): a quantity observed `tau` seconds ago weighs 1/e of one observed now. For busy
time B, dB/dt = busy(t) - B/tau, so B tends to tau for an always-busy pod and
`busy_time_s / tau` is the busy fraction. Latencies are per-sample EWMAs with weight
`alpha` for the newest sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.routing.base import PodStats

__all__ = ["PodStatsTracker"]


@dataclass(slots=True)
class _Pod:
    updated_at: float
    in_flight: int = 0
    busy: float = 0.0  # decayed busy seconds as of updated_at
    tokens: float = 0.0  # decayed token count as of updated_at
    requests_total: int = 0
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


class PodStatsTracker:
    def __init__(self, *, tau: float = 30.0, alpha: float = 0.2) -> None:
        if tau <= 0 or not 0 < alpha <= 1:
            raise ValueError("tau must be positive and alpha in (0, 1]")
        self._tau = tau
        self._alpha = alpha
        self._pods: dict[str, _Pod] = {}

    @property
    def tau(self) -> float:
        return self._tau

    def _advance(self, address: str, now: float) -> _Pod:
        pod = self._pods.get(address)
        if pod is None:
            pod = self._pods[address] = _Pod(updated_at=now)
            return pod
        dt = now - pod.updated_at
        if dt <= 0:  # a non-monotonic caller: never run time backwards
            return pod
        decay = math.exp(-dt / self._tau)
        pod.tokens *= decay
        pod.busy *= decay
        if pod.in_flight > 0:
            pod.busy += self._tau * (1.0 - decay)
        pod.updated_at = now
        return pod

    def request_started(self, address: str, now: float) -> None:
        self._advance(address, now).in_flight += 1

    def request_ended(self, address: str, now: float) -> None:
        """A request this process routed to `address` is over (busy time stops counting)."""
        pod = self._advance(address, now)
        pod.in_flight = max(0, pod.in_flight - 1)

    def observe_response(
        self,
        address: str,
        *,
        now: float,
        latency_s: float | None,
        ttft_s: float | None,
        decode_s: float | None,
        tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """One successful response served by `address` (from any process's routing):
        total and first-token latency from the upstream's view, decode time after the first
        token, and its tokens."""
        pod = self._advance(address, now)
        pod.requests_total += 1
        if tokens is not None and tokens > 0:
            pod.tokens += tokens
        if latency_s is not None:
            pod.latency = _ewma(pod.latency, max(0.0, latency_s), self._alpha)
        if ttft_s is not None:
            pod.ttft = _ewma(pod.ttft, max(0.0, ttft_s), self._alpha)
            if decode_s is not None and completion_tokens is not None and completion_tokens > 1:
                # The first token arrives with the first byte; the rest share the decode time.
                tpot = max(0.0, decode_s) / (completion_tokens - 1)
                pod.tpot = _ewma(pod.tpot, tpot, self._alpha)

    def stats(self, address: str, now: float) -> PodStats:
        if address not in self._pods:
            return PodStats()
        pod = self._advance(address, now)
        return PodStats(
            requests_total=pod.requests_total,
            throughput_tokens_per_s=pod.tokens / self._tau,
            busy_time_s=pod.busy,
            ttft_avg_s=pod.ttft,
            tpot_avg_s=pod.tpot,
            latency_avg_s=pod.latency,
        )

    def forget(self, address: str) -> None:
        """Drop a removed endpoint (keeps memory bounded under churn)."""
        self._pods.pop(address, None)
