"""Subprocess half of test_wire_compat: everything that needs xds-protos' modules.

Reads a JSON request on stdin, writes a JSON answer on stdout (binary as base64):
  in:  {"parse": {sample_name: [message_type, b64 bytes from extproc._pb]}}
  out: {"descriptors": {file_name: b64 FileDescriptorProto},
        "samples": {sample_name: b64 bytes built with xds-protos},
        "reparsed": {sample_name: b64 bytes after parse (unknown fields discarded) + serialize}}
"""

from __future__ import annotations

import base64
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from envoy.config.core.v3 import address_pb2
from envoy.config.core.v3 import base_pb2 as core
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2 as status
from google.protobuf import descriptor_pb2


def _load_samples_module() -> ModuleType:
    path = Path(__file__).with_name("_samples.py")
    spec = importlib.util.spec_from_file_location("_xds_side_samples", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    request = json.load(sys.stdin)
    descriptors = {}
    for module in (core, mode, ep, status, address_pb2, accesslog_pb2, als_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        descriptors[proto.name] = base64.b64encode(proto.SerializeToString()).decode()

    samples = _load_samples_module().build_samples(ep, core, mode, status)
    encoded = {
        name: base64.b64encode(msg.SerializeToString(deterministic=True)).decode()
        for name, msg in samples.items()
    }
    reparsed = {}
    for name, (type_name, data) in request.get("parse", {}).items():
        msg = getattr(ep, type_name).FromString(base64.b64decode(data))
        msg.DiscardUnknownFields()
        reparsed[name] = base64.b64encode(msg.SerializeToString(deterministic=True)).decode()
    als = _access_log_sample()
    json.dump(
        {
            "descriptors": descriptors,
            "samples": encoded,
            "reparsed": reparsed,
            "access_log": base64.b64encode(als.SerializeToString()).decode(),
        },
        sys.stdout,
    )


def _access_log_sample() -> als_pb2.StreamAccessLogsMessage:
    """A first access-log message as Envoy sends it, with fields our trimmed copy leaves out
    (the node identifier, TLS, addresses, headers) around the ones it reads."""
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.node.id = "envoy-0"
    msg.identifier.node.cluster = "gateway"
    msg.identifier.log_name = "extproc-accounting"
    entry = msg.http_logs.log_entry.add()
    entry.protocol_version = accesslog_pb2.HTTPAccessLogEntry.HTTP11
    c = entry.common_properties
    c.sample_rate = 1.0
    c.downstream_remote_address.socket_address.address = "10.9.9.9"
    c.tls_properties.tls_sni_hostname = "llm.example.com"
    c.start_time.seconds = 1_800_000_000
    c.time_to_first_upstream_tx_byte.nanos = 2_000_000
    c.time_to_last_upstream_rx_byte.seconds = 3
    c.upstream_remote_address.socket_address.address = "10.0.0.2"
    c.upstream_remote_address.socket_address.port_value = 8000
    c.upstream_cluster = "models"
    c.response_flags.downstream_connection_termination = True
    c.response_flags.delay_injected = True
    c.metadata.filter_metadata["extproc.usage"].update(
        {"prompt_tokens": 12, "completion_tokens": 3}
    )
    c.route_name = "llm"
    c.upstream_request_attempt_count = 2
    entry.request.request_id = "rid-1"
    entry.request.authority = "llm.example.com"
    entry.request.request_headers["x-user-id"] = "alice"
    entry.response.response_code.value = 200
    entry.response.response_body_bytes = 1234
    return msg


if __name__ == "__main__":
    main()
