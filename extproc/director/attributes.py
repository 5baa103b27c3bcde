"""Who a request is and what it asks of the gateway, read once, here, from its headers, body and
route: its priority, the InferenceObjective it names, its fairness id, user and session, and its
latency SLOs. Every step reads `Request.attributes`; nothing else parses these headers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from extproc.config import RouteSettings, RoutingConfig
from extproc.routing.predicted import (
    LLMD_SLO_TPOT_HEADER,
    LLMD_SLO_TTFT_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    slo_ms,
)
from extproc.types import BadRequest, InferenceRequest

__all__ = [
    "FAIRNESS_HEADERS",
    "MAX_ID",
    "OBJECTIVE_HEADERS",
    "PRIORITY_LIMIT",
    "AttributeReader",
    "RequestAttributes",
    "bounded_id",
    "fairness_id",
]

# Our header's priority is clamped to this range (a client cannot open unbounded bands or
# metric series); InferenceObjective priorities come from the operator and are not.
PRIORITY_LIMIT = 10
# llm-d's names first, then the inference extension's legacy ones.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
# A fairness id or user is a key of flow control's flows, the VTC counters and replica sync's
# charges: one longer than this is kept as its head and a hash of the whole (a client cannot
# make those keys large, and two long ids that share a head stay two).
MAX_ID = 128
_HEAD = MAX_ID - 17  # the head, "~" and 16 hex digits of the hash: MAX_ID characters


def bounded_id(value: str) -> str:
    """`value` when it is at most MAX_ID characters, else its head and a hash of it all."""
    if len(value) <= MAX_ID:
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{value[:_HEAD]}~{digest}"


@dataclass(frozen=True, slots=True)
class RequestAttributes:
    """A request's attributes, as `AttributeReader.read` found them."""

    priority: int = 0  # < 0: sheddable
    objective: str | None = None  # the InferenceObjective it names (header, else its route's)
    fairness_id: str | None = None  # its fairness header, bounded (`bounded_id`)
    user: str | None = None  # the user header, else the body's `user`, else the fairness id
    # (bounded too)
    session: str | None = None  # its session header as sent (a token, or an id it made up)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    @property
    def flow(self) -> str:
        """Its flow in the flow-control queue: the fairness id, else the user ("": none)."""
        return self.fairness_id or self.user or ""


def fairness_id(headers: Mapping[str, str]) -> str | None:
    for name in FAIRNESS_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return bounded_id(value.strip())
    return None


class AttributeReader:
    """Reads `RequestAttributes` (400 naming the header when one is malformed).

    The priority is the priority header's (clamped to +-PRIORITY_LIMIT), else the priority of
    the InferenceObjective the request names, else its route's priority or objective, else 0.
    `objectives` maps an objective's name to its priority (config's and watched resources')."""

    def __init__(self, routing: RoutingConfig, objectives: Callable[[str], int | None]) -> None:
        self._priority_header = routing.priority_header
        self._user_header = routing.user_header
        self._session_header = routing.session_header
        self._objectives = objectives

    def read(
        self, headers: Mapping[str, str], req: InferenceRequest, route: RouteSettings
    ) -> RequestAttributes:
        fairness = fairness_id(headers)
        named = _named_objective(headers)
        return RequestAttributes(
            priority=self._priority(headers, named, route),
            objective=named or route.objective,
            fairness_id=fairness,
            # A request that names no user is its fairness id's (so the VTC counters know it).
            user=_user(headers.get(self._user_header) or req.user) or fairness,
            session=headers.get(self._session_header),
            slo_ttft_ms=slo_ms(headers, SLO_TTFT_HEADER, LLMD_SLO_TTFT_HEADER),
            slo_tpot_ms=slo_ms(headers, SLO_TPOT_HEADER, LLMD_SLO_TPOT_HEADER),
        )

    def _priority(self, headers: Mapping[str, str], named: str | None, route: RouteSettings) -> int:
        raw = headers.get(self._priority_header)
        if raw is not None:
            try:
                return max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, int(raw)))
            except ValueError:
                raise BadRequest(
                    f"{self._priority_header} must be an integer", param="priority"
                ) from None
        if named is not None:
            return self._objectives(named) or 0
        if route.priority is not None:
            return route.priority
        if route.objective is not None:
            return self._objectives(route.objective) or 0
        return 0


def _user(value: str | None) -> str | None:
    return bounded_id(value) if value else None


def _named_objective(headers: Mapping[str, str]) -> str | None:
    """The InferenceObjective the request's header names, if any."""
    for name in OBJECTIVE_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    return None
