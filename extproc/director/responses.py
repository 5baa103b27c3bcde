"""Stored responses (the Responses API) reach the engine that stored them.

vLLM keeps a stored response, and the conversation behind it, in the memory of the engine
that made it: `previous_response_id`, `GET /v1/responses/{id}` and `/cancel` only work there.
The gateway writes each Responses request's `request_id` (vLLM's response id) so that the id
names the pod it was routed to (`SessionTokens.response_id`): any process or replica that
shares the session secret reads the same pod from it, with no shared memory and no delay.

When that pod is not ready (known to the pool: a stale scrape, a restart under way), the
gateway answers 503 `stored_response_unavailable`, so the client retries. When it is gone
(no longer an endpoint of the pool), the gateway cannot tell it from an id it cannot read
(made under another `routing.session_secret`, or before a restart without one): the request
routes by the usual rule and the engine it reaches answers as vLLM does, 404 "Response with
id ... not found" for `previous_response_id`, GET and cancel: the stored responses died with
their pod. The client starts the conversation again, sending its history as `input`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

from extproc.director.lifecycle import Outgoing, Placement, Request
from extproc.metrics.store import ReadyEndpoints
from extproc.routing.base import Decision
from extproc.routing.session import SessionTokens
from extproc.types import RequestKind, ServiceUnavailable

__all__ = ["StampResponseId", "pin_candidates", "stored_response_id", "stored_response_pod"]

_PATH = "/v1/responses/"


class StampResponseId:
    """Pre-request step, after SessionAffinity: a Responses request gets a response id naming
    its pick; when a model rewrite chose the target, the id and the session token carry the
    target's tag, so the conversation's next turns keep that target."""

    def __init__(self, *, tokens: SessionTokens, session_header: str) -> None:
        self._tokens = tokens
        self._session_header = session_header

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        tag = self._tokens.target_tag(req.rewrite.target) if req.rewrite is not None else None
        if req.parsed.kind is RequestKind.RESPONSES:
            out.request_id = self._tokens.response_id(decision.endpoint.address, tag)
        sid = out.set_headers.get(self._session_header)
        if tag is not None and sid is not None:
            out.set_headers[self._session_header] = f"{sid}.{tag}"


def stored_response_id(path: str) -> str | None:
    """The id in `/v1/responses/{id}` (and `/cancel`, `/input_items`), else None."""
    bare = path.split("?", 1)[0]
    if not bare.startswith(_PATH):
        return None
    rid = bare[len(_PATH) :].split("/", 1)[0]
    return rid or None


def stored_response_pod(
    tokens: SessionTokens, response_id: str, ready: Sequence[str], known: Sequence[str]
) -> str | None:
    """The ready pod that stored `response_id`; None when no pod of the pool has it (an id
    this gateway did not make, or its pod is gone). Raises 503 when that pod is known but
    not ready."""
    if not tokens.is_response_id(response_id):
        return None
    pod = tokens.response_pod(response_id, ready)
    if pod is not None:
        return pod
    if tokens.response_pod(response_id, known) is not None:
        raise ServiceUnavailable(
            f"the engine that stored response {response_id!r} is not ready; retry later",
            code="stored_response_unavailable",
        )
    return None


def pin_candidates(
    tokens: SessionTokens, response_id: str, candidates: Any, known: Sequence[str]
) -> Any:
    """The candidates narrowed to the pod that stored `response_id` (unchanged when the id is
    not this gateway's). Keeps the store's columns on its ready list."""
    addresses = [ep.address for ep, _ in candidates]
    pod = stored_response_pod(tokens, response_id, addresses, known)
    if pod is None:
        return candidates
    mask = [a == pod for a in addresses]
    if isinstance(candidates, ReadyEndpoints):
        return candidates.keep(mask)
    return tuple(compress(candidates, mask))
