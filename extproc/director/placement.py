"""The place step (kind in `lifecycle.py`): the candidates of one attempt and their state now.

The candidates are the model's ready endpoints, within the gateway's subset hint, without the
pods that look hung or keep failing (while any other is fit), narrowed to the pod that stored
the request's `previous_response_id`. Their state is one `PodState` each (`snapshot.py`: only
what the strategy reads). The routing layer's view of the request (`RoutingRequest`) is built
here, from the request, once per attempt: its session's candidate depends on the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress

from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.lifecycle import Placement, Request
from extproc.director.responses import pin_candidates
from extproc.director.snapshot import pod_states
from extproc.metrics.store import EndpointStore, ReadyEndpoint, ReadyEndpoints
from extproc.routing.base import RoutingRequest
from extproc.routing.session import SessionTokens
from extproc.types import ServiceUnavailable

__all__ = ["Candidates", "PlaceCandidates", "routing_request"]


class Candidates:
    """A model's ready endpoints fit for a request (possibly none)."""

    def __init__(
        self, *, store: EndpointStore, inflight: InflightTracker, stall_after_s: float
    ) -> None:
        self._store = store
        self._inflight = inflight
        self._stall_after = stall_after_s

    def of(self, req: Request, room: Sequence[str] = ()) -> Sequence[ReadyEndpoint]:
        ready: Sequence[ReadyEndpoint] = self._store.ready(req.runtime.name)
        if room and len(ready) > 1:  # admitted into these pods' room (flow control)
            ready = _keep(ready, [r[0].address in set(room) for r in ready])
        subset = req.head.subset
        if subset is not None:
            allowed = set(subset)
            ready = tuple(r for r in ready if r[0].address in allowed)
        if len(ready) > 1:
            # A hung pod (accepts, never answers) and one whose picks keep failing (5xx, or
            # retried elsewhere by Envoy) still scrape fine; leave them out while any other pod
            # is fit. If every pod looks unfit, none is singled out.
            unfit = self._inflight.failing_addresses() | self._inflight.stalled_addresses(
                self._stall_after
            )
            if unfit:
                ready = _keep(ready, [r[0].address not in unfit for r in ready])
        return ready


def _keep(ready: Sequence[ReadyEndpoint], mask: list[bool]) -> Sequence[ReadyEndpoint]:
    """The endpoints `mask` keeps, unless it keeps none or all. On the store's ready list, its
    columns are kept (gathered by slot)."""
    if not any(mask) or all(mask):
        return ready
    if isinstance(ready, ReadyEndpoints):
        return ready.keep(mask)
    return tuple(compress(ready, mask))


class PlaceCandidates:
    """Implements `PlaceStep`: the candidates (503 when none), pinned to a stored response's
    pod, their `PodState`s, and the routing request with its session's candidate."""

    def __init__(
        self,
        *,
        candidates: Candidates,
        store: EndpointStore,
        inflight: InflightTracker,
        podstats: PodStatsTracker,
        sessions: SessionTokens,
        clock: Callable[[], float],
    ) -> None:
        self._candidates = candidates
        self._store = store
        self._inflight = inflight
        self._podstats = podstats
        self._sessions = sessions
        self._clock = clock

    def place(self, req: Request, room: Sequence[str] = ()) -> Placement:
        runtime = req.runtime
        candidates = self._candidates.of(req, room)
        if not candidates:
            if req.head.subset is not None:
                raise ServiceUnavailable(
                    f"no ready endpoint of model {runtime.name!r} in the gateway's subset hint"
                )
            raise ServiceUnavailable(f"no ready endpoint for model {runtime.name!r}")
        previous = req.parsed.previous_response_id
        if previous is not None:  # only the pod that stored it holds it
            known = [ep.address for ep in self._store.endpoints(runtime.name)]
            candidates = pin_candidates(self._sessions, previous, candidates, known)
        pods = pod_states(
            candidates,
            prefix=runtime.prefix,
            block_hashes=req.prompt.hashes,
            now=self._clock(),
            inflight=self._inflight,
            podstats=self._podstats,
            capabilities=req.strategy.capabilities,
        )
        # Only a ready endpoint of this model: the pod the token names, or a rendezvous pick.
        session = self._sessions.resolve(
            runtime.name, req.attributes.session, [ep.address for ep, _ in candidates]
        )
        return Placement(pods=pods, routing=routing_request(req, session))


def routing_request(req: Request, session_id: str | None) -> RoutingRequest:
    """The routing layer's view of `req`, with its session's candidate (or None)."""
    parsed, prompt, attrs = req.parsed, req.prompt, req.attributes
    return RoutingRequest(
        request_id=req.request_id, model=req.runtime.name, kind=parsed.kind,
        prompt_tokens=prompt.tokens, tokens_estimated=prompt.estimated,
        token_ids=prompt.token_ids, block_hashes=prompt.hashes,
        block_size=req.runtime.block_size, max_tokens=parsed.max_tokens, user=attrs.user,
        session_id=session_id, lora=req.lora, priority=attrs.priority,
        slo_ttft_ms=attrs.slo_ttft_ms, slo_tpot_ms=attrs.slo_tpot_ms, headers=req.head.headers,
    )  # fmt: skip
