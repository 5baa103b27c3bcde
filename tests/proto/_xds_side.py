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

from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
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
    for module in (core, mode, ep, status):
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
    json.dump({"descriptors": descriptors, "samples": encoded, "reparsed": reparsed}, sys.stdout)


if __name__ == "__main__":
    main()
