"""Requests with no body to route on: `GET /v1/models` (answered by the gateway), a stored
response's `GET`/`cancel` (the pod that stored it), anything else (`GET /health`, `/metrics`):
any ready endpoint, least loaded first."""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from extproc.accounting.inflight import InflightTracker
from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.director.lifecycle import RoutingState
from extproc.director.prepare import Models
from extproc.director.responses import stored_response_id, stored_response_pod
from extproc.metrics.store import EndpointStore
from extproc.protocol.openai import kind_for_path
from extproc.routing.base import Decision
from extproc.routing.session import SessionTokens
from extproc.types import BadRequest, Endpoint, NotFound, RequestKind, ServiceUnavailable

__all__ = ["Bodyless", "destinations"]


def destinations(decision: Decision, max_fallbacks: int) -> tuple[str, ...]:
    """The pick, then up to `max_fallbacks` other addresses in rank order (for Envoy's retries)."""
    seen: list[str] = []
    for ep in decision.ranked:
        if ep.address not in seen:
            seen.append(ep.address)
        if len(seen) > max_fallbacks:
            break
    return tuple(seen)


class Bodyless:
    """Routes (or answers) a request that came without a body."""

    def __init__(
        self,
        *,
        models: Models,
        store: EndpointStore,
        inflight: InflightTracker,
        sessions: SessionTokens,
        state: RoutingState,
        max_fallbacks: int,
    ) -> None:
        self._models = models
        self._store = store
        self._inflight = inflight
        self._sessions = sessions
        self._state = state
        self._max_fallbacks = max_fallbacks

    def route(self, head: RequestHead) -> RouteResult | ImmediateReply:
        path = head.path.split("?", 1)[0]
        if head.method == "GET" and path in ("/v1/models", "/models"):
            body = {"object": "list", "data": self._models.cards()}
            return ImmediateReply(status=200, body=orjson.dumps(body))
        if head.method == "GET" and path.startswith(("/v1/models/", "/models/")):
            return self._model_card(path.split("/models/", 1)[1])
        if head.method == "POST" and kind_for_path(path) is not RequestKind.OTHER:
            raise BadRequest("request body is empty; a JSON object is required")
        return self._any_ready(head)

    def _model_card(self, model: str) -> ImmediateReply:
        """`GET /v1/models/{model}`: its card, or OpenAI's 404."""
        for card in self._models.cards():
            if card["id"] == model:
                return ImmediateReply(status=200, body=orjson.dumps(card))
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    def _any_ready(self, head: RequestHead) -> RouteResult:
        ready = [ep for model in self._store.models() for ep, _ in self._store.ready(model)]
        if head.subset is not None:
            ready = [ep for ep in ready if ep.address in set(head.subset)]
        response_id = stored_response_id(head.path)  # GET /v1/responses/{id}, /cancel
        if response_id is not None:
            pod = self._stored_response_pod(response_id, ready)
            if pod is not None:
                return RouteResult(destinations=(pod,))
        if not ready:
            raise ServiceUnavailable("no ready endpoint")
        self._state.rng.shuffle(ready)
        ready.sort(key=lambda ep: self._inflight.load(ep.address).requests)
        decision = Decision(ranked=tuple(ready), strategy="bodyless")
        return RouteResult(destinations=destinations(decision, self._max_fallbacks))

    def _stored_response_pod(self, response_id: str, ready: Sequence[Endpoint]) -> str | None:
        known = [ep.address for ep in self._store.endpoints()]
        addresses = [ep.address for ep in ready]
        return stored_response_pod(self._sessions, response_id, addresses, known)
