"""Per-pod time series for the status page's sparklines: a small ring of samples per pod,
taken by the admin server every `interval_s` (not on the request path).

Each sample: requests served per second and failed picks per second over the last interval
(this process's access records), our in-flight count (this process's and its peers'), and
the gateway-measured TTFT EWMA. Bounded: `size` samples per pod, pods the store no longer
knows are dropped, and at most `max_pods` pods are followed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from extproc.accounting.inflight import InflightTracker

__all__ = ["PodSeries", "Sample"]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # wall clock
    requests_per_s: float | None  # None: the first sample (no interval yet)
    errors_per_s: float | None
    in_flight: int
    ttft_ms: float | None


class PodSeries:
    def __init__(self, *, size: int = 60, max_pods: int = 64) -> None:
        self.size = size
        self.max_pods = max_pods
        self._rings: dict[str, deque[Sample]] = {}
        self._last: dict[str, tuple[float, int, int]] = {}  # address -> (at, served, failed)

    def sample(self, addresses: Iterable[str], inflight: InflightTracker, wall: float) -> None:
        live = list(dict.fromkeys(addresses))[: self.max_pods]
        for gone in set(self._rings) - set(live):
            del self._rings[gone]
            self._last.pop(gone, None)
        for address in live:
            stats = inflight.pod_stats(address)
            served = stats.requests_total if stats is not None else 0
            failed = inflight.failed_total(address)
            rps = eps = None
            previous = self._last.get(address)
            if previous is not None and wall > previous[0]:
                dt = wall - previous[0]
                rps = max(0, served - previous[1]) / dt
                eps = max(0, failed - previous[2]) / dt
            self._last[address] = (wall, served, failed)
            ttft = stats.ttft_avg_s if stats is not None else None
            ring = self._rings.get(address)
            if ring is None:
                ring = self._rings[address] = deque(maxlen=self.size)
            ring.append(
                Sample(
                    at=wall,
                    requests_per_s=rps,
                    errors_per_s=eps,
                    in_flight=inflight.load(address).requests,
                    ttft_ms=None if ttft is None else ttft * 1000.0,
                )
            )

    def json(self, address: str) -> dict[str, list[Any]] | None:
        """Columns of `address`'s samples, oldest first (None if it is not followed)."""
        ring = self._rings.get(address)
        if ring is None:
            return None
        return {
            "at": [s.at for s in ring],
            "requests_per_s": [s.requests_per_s for s in ring],
            "errors_per_s": [s.errors_per_s for s in ring],
            "in_flight": [s.in_flight for s in ring],
            "ttft_ms": [s.ttft_ms for s in ring],
        }
