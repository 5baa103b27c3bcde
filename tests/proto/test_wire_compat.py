"""Wire compatibility of extproc._pb with Envoy's API as published by xds-protos.

xds-protos registers the same protobuf full names as our generated modules, so it is only ever
imported in a subprocess (_xds_side.py); this process compares descriptors and bytes.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, json_format

from extproc._pb.envoy.config.core.v3 import address_pb2
from extproc._pb.envoy.config.core.v3 import base_pb2 as core
from extproc._pb.envoy.data.accesslog.v3 import accesslog_pb2
from extproc._pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc._pb.envoy.type.v3 import http_status_pb2 as status

HERE = Path(__file__).parent
OUR_MODULES: tuple[ModuleType, ...] = (
    core, mode, ep, status, address_pb2, accesslog_pb2, als_pb2,
)  # fmt: skip

Fdp = descriptor_pb2.FileDescriptorProto
Dp = descriptor_pb2.DescriptorProto
Edp = descriptor_pb2.EnumDescriptorProto


def _load_samples() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_our_side_samples", HERE / "_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _file_proto(module: ModuleType) -> Fdp:
    proto = Fdp()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def _walk(proto: Fdp) -> Iterator[tuple[str, Dp | Edp]]:
    """Yield (full name, message or enum descriptor proto), nested ones included."""

    def messages(prefix: str, msgs: Any) -> Iterator[tuple[str, Dp | Edp]]:
        for m in msgs:
            name = f"{prefix}.{m.name}"
            yield name, m
            yield from messages(name, m.nested_type)
            for e in m.enum_type:
                yield f"{name}.{e.name}", e

    yield from messages(proto.package, proto.message_type)
    for e in proto.enum_type:
        yield f"{proto.package}.{e.name}", e


OURS: dict[str, Dp | Edp] = {
    name: d for module in OUR_MODULES for name, d in _walk(_file_proto(module))
}
SAMPLES: dict[str, Any] = _load_samples().build_samples(ep, core, mode, status)


def _run_xds_side(parse: dict[str, tuple[str, str]]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "_xds_side.py")],
        input=json.dumps({"parse": parse}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def xds() -> dict[str, Any]:
    """One subprocess run: Envoy's descriptors, its sample bytes, and our bytes re-parsed by it."""
    parse = {
        name: (type(msg).DESCRIPTOR.name, _b64(msg.SerializeToString(deterministic=True)))
        for name, msg in SAMPLES.items()
    }
    return _run_xds_side(parse)


@pytest.fixture(scope="module")
def theirs(xds: dict[str, Any]) -> dict[str, Dp | Edp]:
    out: dict[str, Dp | Edp] = {}
    for data in xds["descriptors"].values():
        out.update(_walk(Fdp.FromString(base64.b64decode(data))))
    return out


def _field_signature(msg: Dp, field: descriptor_pb2.FieldDescriptorProto) -> tuple[Any, ...]:
    oneof = msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
    return (
        field.number,
        field.type,
        field.label,
        field.type_name,
        oneof,
        field.proto3_optional,
    )


@pytest.mark.parametrize("full_name", sorted(OURS))
def test_definition_matches_envoy(full_name: str, theirs: dict[str, Dp | Edp]) -> None:
    assert full_name in theirs, f"{full_name} does not exist in Envoy's API"
    ours, envoy = OURS[full_name], theirs[full_name]
    if isinstance(ours, Edp):
        assert isinstance(envoy, Edp)
        envoy_values = {v.name: v.number for v in envoy.value}
        for value in ours.value:
            assert envoy_values.get(value.name) == value.number, f"{full_name}.{value.name}"
        return
    assert isinstance(envoy, Dp)
    assert ours.options.map_entry == envoy.options.map_entry
    envoy_fields = {f.name: f for f in envoy.field}
    for field in ours.field:
        assert field.name in envoy_fields, f"{full_name}.{field.name} not in Envoy's API"
        assert _field_signature(ours, field) == _field_signature(envoy, envoy_fields[field.name]), (
            f"{full_name}.{field.name}"
        )


def test_every_message_the_protocol_needs_is_defined() -> None:
    needed = {
        "envoy.service.ext_proc.v3." + n
        for n in [
            "ProcessingRequest",
            "ProcessingResponse",
            "HttpHeaders",
            "HttpBody",
            "HttpTrailers",
            "HeadersResponse",
            "BodyResponse",
            "TrailersResponse",
            "CommonResponse",
            "HeaderMutation",
            "BodyMutation",
            "StreamedBodyResponse",
            "ImmediateResponse",
            "GrpcStatus",
            "ProtocolConfiguration",
        ]
    } | {
        "envoy.config.core.v3.HeaderMap",
        "envoy.config.core.v3.HeaderValue",
        "envoy.config.core.v3.HeaderValueOption",
        "envoy.config.core.v3.Metadata",
        "envoy.type.v3.HttpStatus",
        "envoy.type.v3.StatusCode",
        "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode",
    }
    assert needed <= set(OURS)


def test_service_method_is_envoys() -> None:
    service = ep.DESCRIPTOR.services_by_name["ExternalProcessor"]
    method = service.methods_by_name["Process"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert method.input_type.full_name == "envoy.service.ext_proc.v3.ProcessingRequest"
    assert method.output_type.full_name == "envoy.service.ext_proc.v3.ProcessingResponse"
    assert method.client_streaming and method.server_streaming
    # The generated servicer registers exactly this path with grpc.
    assert callable(ep_grpc.add_ExternalProcessorServicer_to_server)
    assert hasattr(ep_grpc.ExternalProcessorServicer, "Process")


def test_access_log_service_is_envoys() -> None:
    service = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"]
    method = service.methods_by_name["StreamAccessLogs"]
    assert service.full_name == "envoy.service.accesslog.v3.AccessLogService"
    assert method.input_type.full_name == "envoy.service.accesslog.v3.StreamAccessLogsMessage"
    assert method.client_streaming and not method.server_streaming
    assert callable(als_pb2_grpc.add_AccessLogServiceServicer_to_server)


def test_envoys_access_log_message_parses_with_ours(xds: dict[str, Any]) -> None:
    """A full message built with Envoy's own classes (node identifier, TLS, headers...): our
    trimmed copy skips what it leaves out and reads every field it keeps."""
    msg = als_pb2.StreamAccessLogsMessage.FromString(base64.b64decode(xds["access_log"]))
    assert msg.identifier.log_name == "extproc-accounting"
    [entry] = msg.http_logs.log_entry
    c = entry.common_properties
    assert c.start_time.seconds == 1_800_000_000
    assert c.time_to_first_upstream_tx_byte.nanos == 2_000_000
    assert c.time_to_last_upstream_rx_byte.seconds == 3
    sock = c.upstream_remote_address.socket_address
    assert (sock.address, sock.port_value) == ("10.0.0.2", 8000)
    assert c.upstream_cluster == "models" and c.route_name == "llm"
    assert c.response_flags.downstream_connection_termination
    assert c.upstream_request_attempt_count == 2
    usage = json_format.MessageToDict(c.metadata.filter_metadata["extproc.usage"])
    assert usage == {"prompt_tokens": 12, "completion_tokens": 3}
    assert entry.request.request_id == "rid-1"
    assert entry.response.response_code.value == 200
    assert entry.response.response_body_bytes == 1234


def test_generated_code_never_imports_the_envoy_wheels() -> None:
    root = Path(ep.__file__).parents[4]  # extproc/_pb
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py*")
        if p.suffix in (".py", ".pyi")  # not the bytecode beside them
        and any(
            line.startswith(("from envoy", "import envoy")) for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []
    assert "envoy.service.ext_proc.v3.external_processor_pb2" not in sys.modules
    assert "envoy.service.accesslog.v3.als_pb2" not in sys.modules


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_same_bytes_as_envoy(name: str, xds: dict[str, Any]) -> None:
    """The same construction code gives identical bytes with ours and with xds-protos."""
    ours = SAMPLES[name].SerializeToString(deterministic=True)
    assert ours, "sample must not be empty"
    assert _b64(ours) == xds["samples"][name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_envoy_bytes_parse_with_ours(name: str, xds: dict[str, Any]) -> None:
    data = base64.b64decode(xds["samples"][name])
    msg = type(SAMPLES[name]).FromString(data)
    # Discarding unknown fields proves every byte landed in a field we define.
    msg.DiscardUnknownFields()
    assert msg.SerializeToString(deterministic=True) == data
    assert msg == SAMPLES[name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_our_bytes_parse_with_envoys(name: str, xds: dict[str, Any]) -> None:
    ours = SAMPLES[name].SerializeToString(deterministic=True)
    assert base64.b64decode(xds["reparsed"][name]) == ours


def test_sample_fields_survive_the_round_trip(xds: dict[str, Any]) -> None:
    """Spot-check decoded values, so an all-default message cannot pass by accident."""
    req = ep.ProcessingRequest.FromString(base64.b64decode(xds["samples"]["request_headers"]))
    assert req.WhichOneof("request") == "request_headers"
    assert req.protocol_config.request_body_mode == mode.ProcessingMode.FULL_DUPLEX_STREAMED
    hint = json_format.MessageToDict(req.metadata_context.filter_metadata["envoy.lb.subset_hint"])
    assert hint == {"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "10.0.0.2:8000"]}
    resp = ep.ProcessingResponse.FromString(base64.b64decode(xds["samples"]["immediate"]))
    assert resp.immediate_response.status.code == status.TooManyRequests == 429
    metadata = json_format.MessageToDict(resp.dynamic_metadata)
    assert metadata["io.envoy.ai_gateway"] == {"llm_input_token": 12, "llm_output_token": 3}
