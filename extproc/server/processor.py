"""One ext_proc stream: Envoy messages in, Envoy messages out.

This is the thin protocol edge. It knows the processing modes and the message order rules
(headers -> body -> trailers; one answer per message except in FULL_DUPLEX_STREAMED) and
nothing about routing: the director decides, this module encodes.

A stream is the routing stream of one HTTP request, and it lives only as long as the decision:
once the answer is written the server ends it, and Envoy goes on with the request without
the server (so a restart of this process cuts no response it routed). What the decision
claimed (the request's ticket) lives on in the lease book until the request's access-log
record ends it (extproc/director/leases.py); the lease's key rides in the decision's metadata.
The response is not seen here: usage is read inside Envoy and arrives in that record
(server/accesslog.py).

Two request shapes. Two messages each way: request headers (answered CONTINUE), then the
buffered body (answered with the destination as a header mutation and metadata). One message
each way, when Envoy skips request headers: the body message carries what the server reads
from them as request attributes (`request.path`, `request.headers['x-session-id']`, ...), and
the answer carries the headers to set in dynamic metadata (`extproc.wire.HEADERS_NAMESPACE`),
since Envoy drops a body answer's header mutations when it never held the headers; a Lua
filter after this one copies them onto the request (extproc/stack/envoy_config.py). Where no access log is configured (`hold`), the stream stays open for
the whole request and its end closes the ticket. A filter misconfigured to send response messages still gets
well-formed answers (and nothing at all in observability mode), so it can never hang traffic.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc._pb.envoy.config.core.v3 import base_pb2
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.director.api import (
    BodyMode,
    ImmediateReply,
    RequestHandler,
    RequestHead,
    RequestTicket,
    RouteResult,
)
from extproc.wire import (
    ATTRIBUTE_NAMESPACE,
    DESTINATION_HEADER,
    HEADER_ATTRIBUTE,
    HEADERS_NAMESPACE,
    LB_NAMESPACE,
    LEASE_KEY,
    REPLICA_KEY,
    REQUEST_NAMESPACE,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
)

__all__ = ["Phase", "StreamModes", "StreamProcessor", "build_immediate"]

log = logging.getLogger("extproc.server")

MAX_STREAMED_CHUNK = 62_000  # the EPP reference implementation's re-chunk size

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _headers_dict(headers: base_pb2.HeaderMap) -> dict[str, str]:
    # Once per request over a dozen headers: each field read of a upb message makes an object.
    out: dict[str, str] = {}
    for h in headers.headers:
        key = h.key.lower()
        raw = h.raw_value
        value = raw.decode("utf-8", "replace") if raw else h.value
        # Repeated headers are joined the way HTTP folds them.
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


_HEADER_PREFIX, _HEADER_SUFFIX = HEADER_ATTRIBUTE.split("{}")


def _set_headers(mutation: ep.HeaderMutation, headers: Mapping[str, str]) -> None:
    for k, v in headers.items():
        option = mutation.set_headers.add()
        option.header.key = k
        option.header.raw_value = v.encode()
        option.append_action = _OVERWRITE


def _mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def build_immediate(reply: ImmediateReply) -> ep.ProcessingResponse:
    resp = ep.ProcessingResponse()
    imm = resp.immediate_response
    imm.status.code = reply.status  # type: ignore[assignment]
    imm.body = reply.body
    imm.details = reply.details or f"extproc_{reply.status}"
    if reply.headers:
        imm.headers.CopyFrom(_mutation(reply.headers))
    return resp


def _attribute(msg: ep.ProcessingRequest, name: str) -> str | None:
    attrs = msg.attributes.get(ATTRIBUTE_NAMESPACE)
    if attrs is None or name not in attrs.fields:
        return None
    return _attribute_text(attrs.fields[name])


def _attribute_text(value: Any) -> str | None:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value or None
    if kind == "number_value":
        return str(int(value.number_value))
    return None


def _attributes_head(msg: ep.ProcessingRequest, traceparent: str | None) -> RequestHead:
    """The request as a one-message stream tells it: the body message's request attributes
    (`request.id`, `request.method`, `request.path`, one `request.headers['name']` per header
    the server reads; Envoy leaves out headers the request lacks)."""
    headers: dict[str, str] = {}
    named: dict[str, str] = {}
    attrs = msg.attributes.get(ATTRIBUTE_NAMESPACE)
    if attrs is not None:
        for key, value in attrs.fields.items():
            text = _attribute_text(value)
            if text is None:
                continue
            if key.startswith(_HEADER_PREFIX) and key.endswith(_HEADER_SUFFIX):
                headers[key[len(_HEADER_PREFIX) : -len(_HEADER_SUFFIX)].lower()] = text
            else:
                named[key] = text
    request_id = named.get("request.id") or headers.get("x-request-id", "")
    method, path = named.get("request.method", ""), named.get("request.path", "")
    headers.update({":method": method, ":path": path})
    if request_id:
        headers["x-request-id"] = request_id
    return RequestHead(
        request_id=request_id,
        method=method,
        path=path,
        headers=headers,
        route_name=named.get("xds.route_name"),
        subset=_subset_hint(msg),
        has_body=True,
        traceparent=traceparent,
    )


def _subset_hint(msg: ep.ProcessingRequest) -> tuple[str, ...] | None:
    ns = msg.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if ns is None or SUBSET_HINT_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    if kind == "string_value":
        return tuple(p.strip() for p in value.string_value.split(",") if p.strip())
    return ()


def _decision_metadata(resp: ep.ProcessingResponse, result: RouteResult, value: str) -> None:
    fields = resp.dynamic_metadata.fields
    fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    ticket = result.ticket
    lease = ticket is not None and not result.hold
    if not lease and result.routed is None:
        return
    ns = fields[REQUEST_NAMESPACE].struct_value.fields
    if lease:
        # The lease's key, for the access-log record that ends it (whatever process gets it).
        assert ticket is not None
        ns[LEASE_KEY].number_value = ticket.key.seq
        ns[REPLICA_KEY].string_value = ticket.key.replica
    if result.routed is not None:
        for key, v in result.routed.metadata().items():
            if isinstance(v, bool):
                ns[key].bool_value = v
            elif isinstance(v, str):
                ns[key].string_value = v
            else:
                ns[key].number_value = v


class Phase(enum.Enum):
    """Where a stream is. One value, so no two flags can contradict each other."""

    HEADERS = "headers"  # waiting for the request headers
    BODY = "body"  # collecting the request body
    ROUTED = "routed"  # answered with a destination; the answer is being written
    DELIVERED = "delivered"  # the answer is written: the server ends the RPC, the ticket lives on
    HELD = "held"  # answered, no access log: the stream is held until the request ends
    REJECTED = "rejected"  # answered with an immediate reply: the server ends the RPC
    RESPONSE_ENDED = "response_ended"  # observability mode saw the response end: end the RPC
    CLOSED = "closed"  # the stream ended; the ticket (if any) is closed


_ENDS = frozenset({Phase.DELIVERED, Phase.REJECTED, Phase.RESPONSE_ENDED})


@dataclass(frozen=True, slots=True)
class StreamModes:
    """How Envoy said it will talk on this stream (its first message's protocol_config)."""

    request_body: BodyMode = BodyMode.BUFFERED
    response_body: BodyMode = BodyMode.NONE
    no_wait: bool = False  # STREAMED + send_body_without_waiting_for_header_response
    observability: bool = False  # Envoy ignores our answers

    @classmethod
    def of(cls, msg: ep.ProcessingRequest) -> StreamModes:
        if not msg.HasField("protocol_config"):
            # Envoy older than protocol_config: BUFFERED is the only safe assumption for routing.
            return cls(observability=msg.observability_mode)
        pc = msg.protocol_config
        return _modes(
            pc.request_body_mode,
            pc.response_body_mode,
            pc.send_body_without_waiting_for_header_response,
            msg.observability_mode,
        )


@functools.lru_cache(maxsize=64)  # a handful of combinations, one per filter config
def _modes(request: int, response: int, no_wait: bool, observability: bool) -> StreamModes:
    return StreamModes(BodyMode(request), BodyMode(response), no_wait, observability)


class StreamProcessor:
    """State of one ext_proc gRPC stream. Feed messages with `on_message`; write what it returns.

    `traced`: tracing is on, so the request carries its trace context on to the director: the
    stream's own (`traceparent`, from the gRPC metadata of Envoy's ext_proc call: Envoy's span),
    else the request's `traceparent` header (the client's)."""

    def __init__(
        self, handler: RequestHandler, *, traced: bool = False, traceparent: str | None = None
    ) -> None:
        self._handler = handler
        self._traced = traced
        self._traceparent = traceparent
        self.phase = Phase.HEADERS
        self._modes: StreamModes | None = None  # set from the first message
        self._head: RequestHead | None = None
        self._body = bytearray()
        self._body_chunks = 0
        self._ticket: RequestTicket | None = None
        self._hold = False
        self._one_message = False  # request headers skipped: the body message is the request

    @property
    def done(self) -> bool:
        """The server should end the RPC (this side has nothing more to say)."""
        return self.phase in _ENDS

    @property
    def ending(self) -> bool:
        """What `on_message` just returned is this side's last word: once it is written the
        server ends the RPC (`done` after `sent()`)."""
        return self.phase in _ENDS or (self.phase is Phase.ROUTED and not self._hold)

    @property
    def modes(self) -> StreamModes:
        assert self._modes is not None, "set by the stream's first message"
        return self._modes

    # -- public ----------------------------------------------------------------------------

    async def on_message(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if self._modes is None:
            self._modes = StreamModes.of(msg)
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(msg)
        if kind == "request_body":
            if self.phase is Phase.HEADERS:
                return await self._on_first_body(msg)
            return await self._on_request_body(msg.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind in ("response_headers", "response_body", "response_trailers"):
            return self._on_response(msg, kind)
        log.warning("ignoring ext_proc message without a known request field: %s", kind)
        return []

    def sent(self) -> None:
        """Everything `on_message` returned is written to Envoy. A routing answer is then
        delivered: the ticket is the lease book's (its record ends it), the RPC can end."""
        if self.phase is Phase.ROUTED:
            if self._hold:
                self.phase = Phase.HELD
            else:
                self.phase = Phase.DELIVERED
                self._ticket = None

    def close(self) -> None:
        """The stream ended (done, EOF, cancel or error). A ticket still here was never
        delivered, or was held for the request's whole life: it ends now."""
        self.phase = Phase.CLOSED
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ticket.close()

    # -- request path ------------------------------------------------------------------------

    def _reject(self, reply: ImmediateReply) -> list[ep.ProcessingResponse]:
        self.phase = Phase.REJECTED
        return [build_immediate(reply)]

    async def _on_request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if self.phase is not Phase.HEADERS:
            return []
        hdrs = msg.request_headers
        headers = _headers_dict(hdrs.headers)
        self._head = RequestHead(
            request_id=headers.get("x-request-id", ""),
            method=headers.get(":method", ""),
            path=headers.get(":path", ""),
            headers=headers,
            route_name=_attribute(msg, "xds.route_name"),
            subset=_subset_hint(msg),
            has_body=not hdrs.end_of_stream,
            traceparent=(self._traceparent or headers.get("traceparent")) if self._traced else None,
        )
        mode = self.modes.request_body
        if hdrs.end_of_stream or mode == BodyMode.NONE:
            result = await self._handler.route(self._head, None)
            if isinstance(result, ImmediateReply):
                return self._reject(result)
            self._accept(result)
            return [self._headers_response(result)]
        self.phase = Phase.BODY
        if mode == BodyMode.FULL_DUPLEX_STREAMED or (
            mode == BodyMode.STREAMED and self.modes.no_wait
        ):
            return []  # hold the headers answer until the body is complete (pipelined)
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    async def _on_first_body(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """A stream that starts with the body: Envoy skips request headers (one message each
        way). Only a buffered body can still route: in the other modes Envoy passed the
        headers on, and the upstream was chosen, before the body came."""
        self._one_message = True
        self._head = _attributes_head(msg, self._traceparent)
        if self.modes.request_body != BodyMode.BUFFERED:
            return self._reject(
                self._handler.reject(
                    self._head,
                    500,
                    "ext_proc is misconfigured: with request headers skipped, only a BUFFERED "
                    "request body can be routed",
                )
            )
        self.phase = Phase.BODY
        return await self._on_request_body(msg.request_body)

    async def _on_request_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.phase is not Phase.BODY:
            return []
        self._body_chunks += 1
        if len(self._body) + len(body.body) > self._handler.max_body_bytes:
            reply = self._handler.reject(
                self._head, 413, f"request body exceeds {self._handler.max_body_bytes} bytes"
            )
            return self._reject(reply)
        self._body += body.body
        if not body.end_of_stream:
            if self.modes.request_body == BodyMode.STREAMED and not self.modes.no_wait:
                return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
            return []
        return await self._route_with_body(trailers=False)

    async def _on_request_trailers(self) -> list[ep.ProcessingResponse]:
        out: list[ep.ProcessingResponse] = []
        if self.phase is Phase.BODY:
            out = await self._route_with_body(trailers=True)
        if self.phase is not Phase.REJECTED:
            out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out

    async def _route_with_body(self, *, trailers: bool) -> list[ep.ProcessingResponse]:
        assert self._head is not None, "Envoy sends request headers before the body"
        result = await self._handler.route(self._head, bytes(self._body))
        if isinstance(result, ImmediateReply):
            return self._reject(result)
        self._accept(result)
        mode = self.modes.request_body
        if mode == BodyMode.FULL_DUPLEX_STREAMED:
            out = [self._headers_response(result)]
            body = result.body if result.body is not None else bytes(self._body)
            out.extend(_streamed_chunks(body, end=not trailers))
            return out
        if mode == BodyMode.STREAMED and self.modes.no_wait:
            # Headers answer first, then one (empty) answer per body chunk Envoy sent.
            out = [self._headers_response(result)]
            out.extend(
                ep.ProcessingResponse(request_body=ep.BodyResponse())
                for _ in range(self._body_chunks)
            )
            return out
        # BUFFERED: header mutations are honoured in the body answer (when Envoy held the
        # headers; one message each way, they travel as metadata for the Lua filter instead).
        resp = ep.ProcessingResponse()
        common = resp.request_body.response
        headers = dict(result.set_headers)
        destination = headers[DESTINATION_HEADER] = ",".join(result.destinations)
        if result.body is not None:
            common.body_mutation.body = result.body
            common.status = ep.CommonResponse.CONTINUE_AND_REPLACE
        if self._one_message:
            # Envoy dropped content-length when it skipped the headers (chunked upstream).
            common.SetInParent()  # an answer with nothing but metadata is still a body answer
            carried = resp.dynamic_metadata.fields[HEADERS_NAMESPACE].struct_value.fields
            for k, v in headers.items():
                carried[k].string_value = v
        else:
            if result.body is not None:
                headers["content-length"] = str(len(result.body))
            _set_headers(common.header_mutation, headers)
        _decision_metadata(resp, result, destination)
        return [resp]

    def _accept(self, result: RouteResult) -> None:
        self.phase = Phase.ROUTED
        self._ticket = result.ticket
        self._hold = result.hold

    def _headers_response(self, result: RouteResult) -> ep.ProcessingResponse:
        resp = ep.ProcessingResponse()
        common = resp.request_headers.response
        headers = dict(result.set_headers)
        headers[DESTINATION_HEADER] = ",".join(result.destinations)
        _set_headers(common.header_mutation, headers)
        common.clear_route_cache = True
        _decision_metadata(resp, result, headers[DESTINATION_HEADER])
        return resp

    # -- response messages: only from a misconfigured filter --------------------------------

    def _on_response(self, msg: ep.ProcessingRequest, kind: str) -> list[ep.ProcessingResponse]:
        """Usage comes from the access log, not from here. Answer so traffic flows (nothing in
        observability mode, where Envoy ignores answers) and end the stream at the response
        end, so a deferred-closed stream never holds the ext_proc cluster's budget."""
        if self.modes.observability:
            if kind == "response_trailers" or getattr(msg, kind).end_of_stream:
                self.phase = Phase.RESPONSE_ENDED
            return []
        if kind == "response_headers":
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        resp = ep.ProcessingResponse()
        if self.modes.response_body == BodyMode.FULL_DUPLEX_STREAMED:
            # In this mode Envoy forwards only what we send back: echo every chunk.
            sr = resp.response_body.response.body_mutation.streamed_response
            sr.body = msg.response_body.body
            sr.end_of_stream = msg.response_body.end_of_stream
        else:
            resp.response_body.SetInParent()
        return [resp]


def _streamed_chunks(body: bytes, *, end: bool) -> list[ep.ProcessingResponse]:
    out: list[ep.ProcessingResponse] = []
    chunks = [
        body[i : i + MAX_STREAMED_CHUNK] for i in range(0, len(body), MAX_STREAMED_CHUNK)
    ] or [b""]
    for i, chunk in enumerate(chunks):
        resp = ep.ProcessingResponse()
        sr = resp.request_body.response.body_mutation.streamed_response
        sr.body = chunk
        sr.end_of_stream = end and i == len(chunks) - 1
        out.append(resp)
    return out
