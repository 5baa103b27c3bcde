"""Prometheus metrics of KV-event ingestion, registered on an injected registry."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

_M = TypeVar("_M", Counter, Gauge)

__all__ = ["EVENT_KINDS", "PROBE_OUTCOMES", "REPLAY_OUTCOMES", "RESET_REASONS", "KVEventMetrics"]

EVENT_KINDS = ("stored_blocks", "removed_blocks", "cleared", "skipped", "unknown")
REPLAY_OUTCOMES = ("complete", "partial", "failed")
PROBE_OUTCOMES = ("idle", "behind", "failed")  # StreamProbe values
RESET_REASONS = ("gap", "restart", "join")


class KVEventMetrics:
    """Per-pod ingestion counters. One instance per registry (names are registered once)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "extproc") -> None:
        p = prefix
        self.events = Counter(
            f"{p}_kv_events",
            "KV events applied per pod (blocks for stored/removed)",
            ["pod", "kind"],
            registry=registry,
        )
        self.batches = Counter(
            f"{p}_kv_event_batches", "KV-event batches received", ["pod"], registry=registry
        )
        self.lag = Gauge(
            f"{p}_kv_events_lag_seconds",
            "Receive time minus the batch's publish timestamp, last batch",
            ["pod"],
            registry=registry,
        )
        self.gaps = Counter(
            f"{p}_kv_events_gaps", "Sequence gaps detected", ["pod"], registry=registry
        )
        self.replays = Counter(
            f"{p}_kv_events_replays",
            "Replay requests by outcome",
            ["pod", "outcome"],
            registry=registry,
        )
        self.probes = Counter(
            f"{p}_kv_events_probes",
            "Replay-socket liveness probes by answer: idle (nothing newer), behind (batches "
            "the live socket never delivered), failed (no answer)",
            ["pod", "outcome"],
            registry=registry,
        )
        self.resets = Counter(
            f"{p}_kv_events_resets",
            "Times a pod's entries were dropped and rebuilt from live events",
            ["pod", "reason"],
            registry=registry,
        )
        self.decode_errors = Counter(
            f"{p}_kv_events_decode_errors",
            "Malformed KV-event messages skipped",
            ["pod"],
            registry=registry,
        )
        self.orphans = Counter(
            f"{p}_kv_events_orphan_blocks",
            "Stored blocks dropped because their parent block was unknown",
            ["pod"],
            registry=registry,
        )
        self.index_blocks = Gauge(
            f"{p}_kv_index_pod_blocks",
            "Blocks the exact index holds for the pod",
            ["pod"],
            registry=registry,
        )
        self.healthy = Gauge(
            f"{p}_kv_events_healthy",
            "1 while the pod's KV-event stream is alive (exact mode usable): it has spoken, and "
            "no request that should have produced events went unanswered past "
            "kv_events.stall_after_s unless the replay socket showed nothing was missed",
            ["pod"],
            registry=registry,
        )

        # Series already looked up, by metric and labels: `labels()` takes a lock and
        # validates the labels, and every batch counts into a few series.
        self._series: dict[tuple[int, tuple[str, ...]], Counter | Gauge] = {}

    def series(self, metric: _M, *labels: str) -> _M:
        """`metric.labels(*labels)`, looked up once (the first label is the pod)."""
        key = (id(metric), labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child  # type: ignore[return-value]

    def watch(self, pod: str, blocks: Callable[[], int], healthy: Callable[[], bool]) -> None:
        """Gauges read at scrape time, so the hot path never updates them."""
        self.index_blocks.labels(pod).set_function(lambda: float(blocks()))
        self.healthy.labels(pod).set_function(lambda: 1.0 if healthy() else 0.0)

    def forget(self, pod: str) -> None:
        """Remove a departed pod's series (and the closures the gauges hold)."""
        for key in [k for k in self._series if k[1][0] == pod]:
            del self._series[key]
        for metric in (
            self.batches,
            self.lag,
            self.gaps,
            self.decode_errors,
            self.orphans,
            self.index_blocks,
            self.healthy,
        ):
            _remove(metric, pod)
        for kind in EVENT_KINDS:
            _remove(self.events, pod, kind)
        for outcome in REPLAY_OUTCOMES:
            _remove(self.replays, pod, outcome)
        for reason in RESET_REASONS:
            _remove(self.resets, pod, reason)
        for answer in PROBE_OUTCOMES:
            _remove(self.probes, pod, answer)


def _remove(metric: Counter | Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # that series was never created
        metric.remove(*labels)
