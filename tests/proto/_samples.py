"""Sample ext_proc messages, built from whichever generated modules are passed in.

The same builder runs against xds-protos (in a subprocess) and against extproc._pb (in the
test process), so the two serializations can be compared byte for byte. It imports no
protobuf module itself: the two sets register the same full names and cannot share a process.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["build_samples"]


def build_samples(
    ep: ModuleType, core: ModuleType, mode: ModuleType, status: ModuleType
) -> dict[str, Any]:
    """Return {name: message} covering every message type, oneof branch and enum we use."""
    pm = mode.ProcessingMode
    req_headers = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                    core.HeaderValue(key="x-gateway-destination-endpoint", value="10.0.0.1:8000"),
                ]
            ),
            end_of_stream=False,
        ),
        metadata_context=core.Metadata(),
        observability_mode=False,
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=pm.FULL_DUPLEX_STREAMED,
            response_body_mode=pm.STREAMED,
            send_body_without_waiting_for_header_response=True,
        ),
    )
    req_headers.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "10.0.0.2:8000"]}
    )
    req_headers.attributes["envoy.filters.http.ext_proc"].update({"xds.route_name": "r0"})

    req_body = ep.ProcessingRequest(
        request_body=ep.HttpBody(
            body=b'{"model":"m","messages":[]}',
            end_of_stream=True,
            end_of_stream_without_message=False,
            grpc_message_compressed=False,
        )
    )
    resp_body = ep.ProcessingRequest(
        response_body=ep.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True),
        observability_mode=True,
    )
    trailers = ep.ProcessingRequest(
        request_trailers=ep.HttpTrailers(
            trailers=core.HeaderMap(headers=[core.HeaderValue(key="grpc-status", value="0")])
        )
    )

    routed = ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                status=ep.CommonResponse.CONTINUE,
                header_mutation=ep.HeaderMutation(
                    set_headers=[
                        core.HeaderValueOption(
                            header=core.HeaderValue(
                                key="x-gateway-destination-endpoint",
                                raw_value=b"10.0.0.1:8000,10.0.0.2:8000",
                            ),
                            append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                            keep_empty_value=False,
                        )
                    ],
                    remove_headers=["content-length"],
                ),
                clear_route_cache=True,
            )
        ),
        mode_override=pm(
            request_header_mode=pm.SEND,
            response_header_mode=pm.SKIP,
            request_body_mode=pm.BUFFERED,
            response_body_mode=pm.STREAMED,
            request_trailer_mode=pm.SKIP,
            response_trailer_mode=pm.SEND,
        ),
        request_drain=False,
    )
    routed.dynamic_metadata.update(
        {"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.1:8000,10.0.0.2:8000"}}
    )
    routed.override_message_timeout.seconds = 3
    routed.override_message_timeout.nanos = 500

    streamed = ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                status=ep.CommonResponse.CONTINUE_AND_REPLACE,
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(body=b"x" * 100, end_of_stream=True)
                ),
                trailers=core.HeaderMap(headers=[core.HeaderValue(key="t", value="v")]),
            )
        )
    )
    replaced = ep.ProcessingResponse(
        response_body=ep.BodyResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=b"{}"))
        )
    )
    cleared = ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(clear_body=True))
        )
    )
    trailers_resp = ep.ProcessingResponse(
        request_trailers=ep.TrailersResponse(
            header_mutation=ep.HeaderMutation(remove_headers=["te"])
        )
    )
    error = ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=status.HttpStatus(code=status.TooManyRequests),
            headers=ep.HeaderMutation(
                set_headers=[
                    core.HeaderValueOption(
                        header=core.HeaderValue(key="content-type", value="application/json")
                    )
                ]
            ),
            body=b'{"error":{"message":"busy","code":429}}',
            grpc_status=ep.GrpcStatus(status=8),
            details="shed",
        )
    )
    error.dynamic_metadata.update(
        {"io.envoy.ai_gateway": {"llm_input_token": 12, "llm_output_token": 3}}
    )
    return {
        "request_headers": req_headers,
        "request_body": req_body,
        "response_body": resp_body,
        "request_trailers": trailers,
        "routed": routed,
        "streamed": streamed,
        "replaced": replaced,
        "cleared": cleared,
        "trailers_response": trailers_resp,
        "immediate": error,
    }
