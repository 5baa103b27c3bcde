"""One ext_proc stream: Envoy messages in, Envoy messages out.

This is the thin protocol edge. It knows the processing modes and the message order rules
(headers -> body -> trailers; one answer per message except in FULL_DUPLEX_STREAMED and
observability mode) and nothing about routing: the director decides, this module encodes.

Two kinds of stream reach it:
- the routing stream (request headers + body, and in single-filter mode the response too);
- a response-only stream from a second filter in observability mode: Envoy ignores anything
  we answer, so we answer nothing and end the RPC at the response end_of_stream (otherwise
  Envoy keeps it open for deferred_close_timeout and the ext_proc cluster's circuit breaker
  fills up; see docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from extproc._pb.envoy.config.core.v3 import base_pb2
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.director.api import (
    BodyMode,
    ImmediateReply,
    RequestHandler,
    RequestHead,
    ResponseObserver,
    RouteResult,
)

__all__ = [
    "ATTRIBUTE_NAMESPACE",
    "DESTINATION_HEADER",
    "StreamProcessor",
    "build_immediate",
]

log = logging.getLogger("extproc.server")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
TOKEN_NAMESPACE = "io.envoy.ai_gateway"
ATTRIBUTE_NAMESPACE = "envoy.filters.http.ext_proc"
MAX_STREAMED_CHUNK = 62_000  # the EPP reference implementation's re-chunk size

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _headers_dict(headers: base_pb2.HeaderMap) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers:
        key = h.key.lower()
        value = _header_value(h)
        # Repeated headers are joined the way HTTP folds them.
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


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
    value = attrs.fields[name]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value or None
    if kind == "number_value":
        return str(int(value.number_value))
    return None


def _subset_hint(msg: ep.ProcessingRequest) -> tuple[str, ...] | None:
    ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    if kind == "string_value":
        return tuple(p.strip() for p in value.string_value.split(",") if p.strip())
    return ()


def _destination_metadata(resp: ep.ProcessingResponse, value: str) -> None:
    resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = value


def _token_metadata(resp: ep.ProcessingResponse, values: Mapping[str, float]) -> None:
    if values:
        ns = resp.dynamic_metadata.fields[TOKEN_NAMESPACE].struct_value
        for k, v in values.items():
            ns.fields[k].number_value = v


class StreamProcessor:
    """State of one ext_proc gRPC stream. Feed messages with `on_message`; write what it returns."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler
        self._request_body_mode = BodyMode.NONE
        self._response_body_mode = BodyMode.NONE
        self._no_wait = False  # STREAMED + send_body_without_waiting_for_header_response
        self._configured = False
        self._observability = False
        self._head: RequestHead | None = None
        self._body = bytearray()
        self._body_chunks = 0
        self._routed = False
        self._rejected = False
        self._observer: ResponseObserver | None = None
        self._owns_observer = False  # True when this stream sees the response itself
        self._response_headers: Mapping[str, str] = {}
        self._response_done = False
        self.done = False  # the server should end the RPC

    # -- public ----------------------------------------------------------------------------

    async def on_message(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if not self._configured:
            self._configure(msg)
        kind = msg.WhichOneof("request")
        if self._observability:
            self._observe_only(msg, kind)
            return []
        if kind == "request_headers":
            return await self._on_request_headers(msg)
        if kind == "request_body":
            return await self._on_request_body(msg.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind == "response_headers":
            return self._on_response_headers(msg.response_headers)
        if kind == "response_body":
            return self._on_response_body(msg.response_body)
        if kind == "response_trailers":
            return self._on_response_trailers()
        log.warning("ignoring ext_proc message without a known request field: %s", kind)
        return []

    def close(self) -> None:
        """The stream ended (EOF, cancel or error): settle what this stream owns."""
        if self._observer is not None and self._owns_observer and not self._response_done:
            self._observer.finish(complete=False)
        elif self._routed and not self._owns_observer and self._head is not None:
            self._handler.request_closed(self._head.request_id)
        self._observer = None

    # -- configuration -----------------------------------------------------------------------

    def _configure(self, msg: ep.ProcessingRequest) -> None:
        self._configured = True
        self._observability = msg.observability_mode
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self._request_body_mode = BodyMode(pc.request_body_mode)
            self._response_body_mode = BodyMode(pc.response_body_mode)
            self._no_wait = pc.send_body_without_waiting_for_header_response
        else:
            # Envoy older than protocol_config: BUFFERED is the only safe assumption for routing.
            self._request_body_mode = BodyMode.BUFFERED

    # -- observability (response-only) stream ---------------------------------------------

    def _observe_only(self, msg: ep.ProcessingRequest, kind: str | None) -> None:
        if self._observer is None and not self._response_done:
            request_id = _attribute(msg, "request.id")
            if request_id is None and kind == "response_headers":
                request_id = _headers_dict(msg.response_headers.headers).get("x-request-id")
            if request_id is not None:
                self._observer = self._handler.observer_for(request_id)
                self._owns_observer = self._observer is not None
        obs = self._observer
        if kind == "response_headers":
            hdrs = msg.response_headers
            if obs is not None:
                headers = _headers_dict(hdrs.headers)
                obs.on_headers(_status(headers), headers)
            if hdrs.end_of_stream:
                self._finish_response(complete=True)
        elif kind == "response_body":
            body = msg.response_body
            if obs is not None:
                obs.on_body(body.body, body.end_of_stream)
            if body.end_of_stream:
                self._finish_response(complete=True)
        elif kind == "response_trailers":
            self._finish_response(complete=True)
        if self._response_done:
            self.done = True

    def _finish_response(self, *, complete: bool) -> dict[str, float]:
        self._response_done = True
        if self._observer is None:
            return {}
        return dict(self._observer.finish(complete=complete))

    # -- request path ------------------------------------------------------------------------

    async def _on_request_headers(self, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
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
        )
        if hdrs.end_of_stream or self._request_body_mode == BodyMode.NONE:
            return [self._answer_headers(await self._handler.route(self._head, None))]
        if self._request_body_mode in (BodyMode.FULL_DUPLEX_STREAMED,) or (
            self._request_body_mode == BodyMode.STREAMED and self._no_wait
        ):
            return []  # hold the headers answer until the body is complete (pipelined)
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    async def _on_request_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self._rejected or self._routed:
            return []
        self._body_chunks += 1
        if len(self._body) + len(body.body) > self._handler.max_body_bytes:
            self._rejected = True
            self.done = True
            reply = self._handler.reject(
                self._head, 413, f"request body exceeds {self._handler.max_body_bytes} bytes"
            )
            return [build_immediate(reply)]
        self._body += body.body
        if not body.end_of_stream:
            if self._request_body_mode == BodyMode.STREAMED and not self._no_wait:
                return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
            return []
        return await self._route_with_body(trailers=False)

    async def _on_request_trailers(self) -> list[ep.ProcessingResponse]:
        out: list[ep.ProcessingResponse] = []
        if not self._routed and not self._rejected:
            out = await self._route_with_body(trailers=True)
        if not self._rejected:
            out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out

    async def _route_with_body(self, *, trailers: bool) -> list[ep.ProcessingResponse]:
        assert self._head is not None, "Envoy sends request headers before the body"
        result = await self._handler.route(self._head, bytes(self._body))
        if isinstance(result, ImmediateReply):
            self._rejected = True
            self.done = True
            return [build_immediate(result)]
        self._accept(result)
        mode = self._request_body_mode
        if mode == BodyMode.FULL_DUPLEX_STREAMED:
            out = [self._headers_response(result)]
            body = result.body if result.body is not None else bytes(self._body)
            out.extend(_streamed_chunks(body, end=not trailers))
            return out
        if mode == BodyMode.STREAMED and self._no_wait:
            # Headers answer first, then one (empty) answer per body chunk Envoy sent.
            out = [self._headers_response(result)]
            out.extend(
                ep.ProcessingResponse(request_body=ep.BodyResponse())
                for _ in range(self._body_chunks)
            )
            return out
        # BUFFERED: header mutations are honoured in the body answer.
        resp = ep.ProcessingResponse()
        common = resp.request_body.response
        headers = dict(result.set_headers)
        headers[DESTINATION_HEADER] = ",".join(result.destinations)
        if result.body is not None:
            headers["content-length"] = str(len(result.body))
            common.body_mutation.body = result.body
            common.status = ep.CommonResponse.CONTINUE_AND_REPLACE
        common.header_mutation.CopyFrom(_mutation(headers))
        _destination_metadata(resp, headers[DESTINATION_HEADER])
        return [resp]

    def _answer_headers(self, result: RouteResult | ImmediateReply) -> ep.ProcessingResponse:
        if isinstance(result, ImmediateReply):
            self._rejected = True
            self.done = True
            return build_immediate(result)
        self._accept(result)
        return self._headers_response(result)

    def _accept(self, result: RouteResult) -> None:
        self._routed = True
        self._observer = result.observer
        self._response_headers = result.response_headers
        # This stream sees the response only when its filter sends response messages.
        self._owns_observer = self._response_body_mode != BodyMode.NONE

    def _headers_response(self, result: RouteResult) -> ep.ProcessingResponse:
        resp = ep.ProcessingResponse()
        common = resp.request_headers.response
        headers = dict(result.set_headers)
        headers[DESTINATION_HEADER] = ",".join(result.destinations)
        common.header_mutation.CopyFrom(_mutation(headers))
        common.clear_route_cache = True
        _destination_metadata(resp, headers[DESTINATION_HEADER])
        return resp

    # -- response path (single-filter modes) ---------------------------------------------------

    def _on_response_headers(self, hdrs: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        headers = _headers_dict(hdrs.headers)
        if self._observer is not None:
            self._observer.on_headers(_status(headers), headers)
        resp = ep.ProcessingResponse()
        common = resp.response_headers.response
        common.SetInParent()
        if self._response_headers:
            common.header_mutation.CopyFrom(_mutation(self._response_headers))
        if hdrs.end_of_stream:
            _token_metadata(resp, self._finish_response(complete=True))
        return [resp]

    def _on_response_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self._observer is not None and not self._response_done:
            self._observer.on_body(body.body, body.end_of_stream)
        resp = ep.ProcessingResponse()
        if self._response_body_mode == BodyMode.FULL_DUPLEX_STREAMED:
            sr = resp.response_body.response.body_mutation.streamed_response
            sr.body = body.body
            sr.end_of_stream = body.end_of_stream
        else:
            resp.response_body.SetInParent()
        if body.end_of_stream:
            _token_metadata(resp, self._finish_response(complete=True))
        return [resp]

    def _on_response_trailers(self) -> list[ep.ProcessingResponse]:
        resp = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        if not self._response_done:
            _token_metadata(resp, self._finish_response(complete=True))
        return [resp]


def _status(headers: Mapping[str, str]) -> int:
    try:
        return int(headers.get(":status", "0"))
    except ValueError:
        return 0


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
