"""The lifecycle steps of the predicted-latency models (`extproc.accounting.latency_model`).

- `MarkRouted` (pre-request): the pick's model notes that this process sent it a request. The
  strategy reads it (it probes only pods nobody was sent a request for `probe_after_s`) and
  never writes it, so an explain (a dry run: no pre-request step) changes no later decision.
- `TagLatency` (pre-request, after `TagForAccounting`): what the decision knew about the pick
  (its `LatencyFeatures`) and, once the pod's model is warm, the prediction, into the request's
  `extproc.request` metadata, whatever the strategy, so every tokenized request teaches the
  model and every prediction is checked.
- `LearnLatency` (response-complete, on whatever process gets the record): the observed TTFT and
  time per output token against the tag: the prediction's error is exported, then the pod's
  model learns the sample.

Only streamed answers teach: a non-streamed answer's first content byte is its last, so it has
no TTFT of its own. Requests whose prompt was estimated (a strategy that does not tokenize) carry
no tag: their uncached-token count would be a guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from extproc.accounting.latency_model import DecisionTag, LatencyMetrics, LatencyModels
from extproc.director.api import AccessRecord, Outcome
from extproc.director.lifecycle import Completed, Outgoing, Placement, Request
from extproc.routing.base import Decision
from extproc.routing.predicted import latency_features

__all__ = ["LatencyShare", "LearnLatency", "MarkRouted", "TagLatency", "observed_latency"]

# (model, pod, decision tag, ttft_s, tpot_s) to the peer replicas (StateSync.note_latency).
LatencyShare = Callable[[str, str, str, float | None, float | None], None]


class MarkRouted:
    """Pre-request: the pick was sent a request now (a real one), whatever the strategy."""

    def __init__(self, *, models: LatencyModels) -> None:
        self._models = models

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        self._models.routed(req.runtime.name, decision.endpoint.address)


class TagLatency:
    """Pre-request: the pick's features and prediction, for the access-log record."""

    def __init__(self, *, models: LatencyModels) -> None:
        self._models = models

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if out.routed is None or req.prompt.estimated or not req.parsed.stream:
            return
        address = decision.endpoint.address
        pod = place.pod(address)
        if pod is None:
            return
        features = latency_features(place.routing, pod)
        pred = self._models.predict(req.runtime.name, address, features)
        tag = DecisionTag(features)
        if pred is not None:
            tag = DecisionTag(features, pred.ttft_s, pred.tpot_s)
        out.routed = dataclasses.replace(out.routed, latency=tag.encode())


def observed_latency(record: AccessRecord) -> tuple[float | None, float | None]:
    """(TTFT, time per output token) of a complete streamed answer, as Envoy timed it: from the
    first byte sent upstream to the first content token, then the rest over the tokens after
    the first. None where the record cannot tell."""
    sent, first, last = record.upstream_sent_s, record.first_token_s, record.upstream_done_s
    if sent is None or first is None:
        return None, None
    ttft = first - sent
    tpot = None
    tokens = record.usage.completion_tokens
    if last is not None and tokens is not None and tokens >= 2 and not record.usage.counted:
        tpot = (last - first) / (tokens - 1)
    return ttft, tpot


class LearnLatency:
    """Response-complete: the prediction's error per pod, then the pod's model learns, and
    the sample goes to the peer replicas (`share`), which learn it too (Envoy sends a worker's
    records to one process only)."""

    def __init__(
        self, *, models: LatencyModels, metrics: LatencyMetrics, share: LatencyShare | None = None
    ) -> None:
        self._models = models
        self._metrics = metrics
        self._share = share

    def complete(self, done: Completed) -> None:
        routed, record = done.routed, done.record
        if not routed.latency or not routed.stream:
            return
        if record.outcome is not Outcome.COMPLETE or not 200 <= done.status < 300:
            return
        if done.endpoint != routed.endpoint:
            return  # served by a fallback: the features were the pick's
        tag = DecisionTag.decode(routed.latency)
        if tag is None:
            return
        ttft, tpot = observed_latency(record)
        if ttft is not None and tag.ttft_s is not None and ttft >= 0:
            self._metrics.observe_error(done.endpoint, "ttft", abs(tag.ttft_s - ttft))
            self._models.checked(
                routed.model, done.endpoint, (tag.ttft_s, tag.tpot_s), (ttft, tpot)
            )
        if tpot is not None and tag.tpot_s is not None and tpot >= 0:
            self._metrics.observe_error(done.endpoint, "tpot", abs(tag.tpot_s - tpot))
        learned = self._models.observe(
            routed.model, done.endpoint, tag.features, ttft_s=ttft, tpot_s=tpot
        )
        if learned and self._share is not None:
            self._share(routed.model, done.endpoint, routed.latency, ttft, tpot)
