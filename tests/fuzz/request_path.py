"""The request path under hostile input: Envoy messages -> StreamProcessor -> real Director.

Shared by the atheris target (fuzz_request_path.py) and the hypothesis property tests
(tests/property/test_request_path.py). `RequestPath.run(case)` raises AssertionError when an
invariant breaks:
- the stream never raises and answers with well-formed ProcessingResponses;
- an error is an ImmediateResponse with one of the statuses the design names (never 500:
  a 500 is an exception the director caught, i.e. a bug);
- a routed request only ever goes to endpoints of the pool (client headers, session ids and
  subset hints cannot name anything else);
- nothing is stuck: no request is left awaiting a decision, and after the stream closes and
  the stream has ended no in-flight lease remains.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from google.protobuf import struct_pb2

from extproc._pb.envoy.config.core.v3 import base_pb2
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.server.processor import StreamProcessor
from extproc.wire import DESTINATION_HEADER, LB_NAMESPACE
from extproc.wire import SUBSET_HINT_KEY as SUBSET_KEY
from extproc.wire import SUBSET_HINT_NAMESPACE as SUBSET_NAMESPACE
from tests._director import OTHER_POOL, POOL, DirectorKit, build_director, config_text

__all__ = ["ALLOWED_STATUSES", "Case", "RequestPath", "case_from_bytes"]

ALLOWED_STATUSES = frozenset({200, 400, 404, 413, 429, 503})
MAX_BODY = 16 * 1024
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/x",
)
MODES = (1, 2, 4)  # STREAMED, BUFFERED, FULL_DUPLEX_STREAMED
HEADER_NAMES = (
    DESTINATION_HEADER,
    "x-session-id",
    "routing-strategy",
    "x-request-priority",
    "x-user-id",
    "x-routing-explain",
    "authorization",
    "content-type",
    "x-request-id",
)


@dataclass
class Case:
    mode: int = 2
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    subset: list[str] | None = None
    trailers: bool = False
    no_wait: bool = False


def case_from_bytes(data: bytes) -> Case:
    """Decode arbitrary bytes into a Case (for atheris; every byte string is a valid case)."""
    import atheris  # type: ignore[import-untyped]  # the fuzz extra; only the fuzz target uses it

    fdp = atheris.FuzzedDataProvider(data)
    case = Case(
        mode=MODES[fdp.ConsumeIntInRange(0, len(MODES) - 1)],
        method=fdp.PickValueInList(["POST", "GET", "PUT", ""]),
        trailers=fdp.ConsumeBool(),
        no_wait=fdp.ConsumeBool(),
    )
    case.path = (
        fdp.PickValueInList(list(PATHS))
        if fdp.ConsumeBool()
        else fdp.ConsumeUnicodeNoSurrogates(40)
    )
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        name = fdp.PickValueInList(list(HEADER_NAMES))
        value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 60))
        if name == "x-session-id" and fdp.ConsumeBool():  # a well-formed id for a foreign pod
            value = base64.b64encode(b"10.66.0.1:" + value[:5])
        case.headers.append((name, value))
    if fdp.ConsumeBool():
        case.subset = [
            fdp.PickValueInList([*POOL, *OTHER_POOL, "10.9.9.9:1", ""]) for _ in range(2)
        ]
    body = _body(fdp)
    cuts = sorted({fdp.ConsumeIntInRange(0, len(body)) for _ in range(fdp.ConsumeIntInRange(0, 3))})
    prev = 0
    for cut in [*cuts, len(body)]:
        case.chunks.append(body[prev:cut])
        prev = cut
    return case


def _body(fdp: object) -> bytes:
    """Mostly JSON near a valid request (wrong types, odd values), sometimes raw bytes."""
    import atheris  # type: ignore[import-untyped]

    assert isinstance(fdp, atheris.FuzzedDataProvider)
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 0:
        return bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, MAX_BODY + 256)))
    body: dict[str, object] = {
        "model": fdp.PickValueInList(["qwen3", "other", "", "nope"]),
        "messages": [{"role": "user", "content": "hello"}],
        "prompt": "hi",
        "max_tokens": 4,
    }
    values: list[object] = [
        None, True, -1, 0, 2**70, 1.5, float("nan"), "", "x" * 50, [], [1], {}, {"a": []},
        [{"role": "user", "content": None}], [{"role": 3, "content": [{"type": "text", "text": "y"}]}],
        [{"role": "user", "content": [{"type": "image_url"}]}], fdp.ConsumeUnicodeNoSurrogates(30),
    ]  # fmt: skip
    keys = ["model", "messages", "prompt", "max_tokens", "stream", "stream_options", "tools",
            "prompt_token_ids", "n", "input", "chat_template_kwargs", "add_generation_prompt", "user"]  # fmt: skip
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        body[fdp.PickValueInList(keys)] = fdp.PickValueInList(values)
    if kind == 2:  # deep nesting
        depth = fdp.ConsumeIntInRange(1, 5000)
        body["messages"] = orjson.Fragment(b"[" * depth + b"]" * depth)  # type: ignore[attr-defined]
    if kind == 3:
        body["messages"] = [{"role": "user", "content": "m"}] * fdp.ConsumeIntInRange(0, 2000)
    try:
        return orjson.dumps(body)
    except (orjson.JSONEncodeError, TypeError):
        return b'{"model": "qwen3"'


def _headers(case: Case) -> base_pb2.HeaderMap:
    hm = base_pb2.HeaderMap()
    base = [(":method", case.method.encode()), (":path", case.path.encode("utf-8", "replace"))]
    for k, v in [*base, *case.headers]:
        hm.headers.append(base_pb2.HeaderValue(key=k, raw_value=v))
    return hm


class RequestPath:
    """One real Director (Qwen3 tokenizer) reused across cases on one event loop."""

    def __init__(self, tokenizer_dir: Path) -> None:
        # Fuzzing is noisy by design; `close` puts the level back (a test run goes on after).
        self._logger = logging.getLogger("extproc")
        self._level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)
        self.kit: DirectorKit = build_director(config_text(max_body=MAX_BODY), tokenizer_dir)
        self.cases = 0
        self.routed = 0
        self.statuses: dict[int, int] = {}
        self.last_destinations: tuple[str, ...] = ()

    def close(self) -> None:
        self.kit.close()
        self._logger.setLevel(self._level)

    async def run(self, case: Case) -> None:
        self.cases += 1
        director = self.kit.director
        proc = StreamProcessor(director)
        messages = self._messages(case)
        out: list[ep.ProcessingResponse] = []
        try:
            for msg in messages:
                out.extend(await proc.on_message(msg))
                if proc.done:
                    break
        finally:
            proc.close()
        self._check(out)
        assert director.deciding == 0, "a request is stuck awaiting a decision"
        # The stream ended: nothing it claimed may be left over.
        assert director.lease_count() == 0, "an in-flight lease leaked"

    def _messages(self, case: Case) -> list[ep.ProcessingRequest]:
        first = ep.ProcessingRequest()
        first.request_headers.headers.CopyFrom(_headers(case))
        has_body = any(case.chunks) or case.trailers
        first.request_headers.end_of_stream = not has_body
        first.protocol_config.request_body_mode = case.mode  # type: ignore[assignment]
        first.protocol_config.send_body_without_waiting_for_header_response = case.no_wait
        if case.subset is not None:
            hint = struct_pb2.Struct()
            hint.fields[SUBSET_KEY].string_value = ",".join(case.subset)
            first.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
        msgs = [first]
        if has_body:
            chunks = case.chunks or [b""]
            for i, chunk in enumerate(chunks):
                m = ep.ProcessingRequest()
                m.request_body.body = chunk
                m.request_body.end_of_stream = i == len(chunks) - 1 and not case.trailers
                msgs.append(m)
            if case.trailers:
                m = ep.ProcessingRequest()
                m.request_trailers.SetInParent()
                msgs.append(m)
        return msgs

    def _check(self, out: list[ep.ProcessingResponse]) -> None:
        allowed = {*POOL, *OTHER_POOL}
        for resp in out:
            resp.SerializeToString()  # well-formed on the wire
            kind = resp.WhichOneof("response")
            assert kind is not None, "an empty ProcessingResponse"
            if kind == "immediate_response":
                status = int(resp.immediate_response.status.code)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                assert status in ALLOWED_STATUSES, (
                    f"unexpected status {status}: {resp.immediate_response.body[:300]!r}"
                )
                if status != 200:
                    err = orjson.loads(resp.immediate_response.body)["error"]
                    assert isinstance(err["message"], str) and err["message"]
                continue
            lb = resp.dynamic_metadata.fields.get(LB_NAMESPACE)
            if lb is not None:
                self.routed += 1
                value = lb.struct_value.fields[DESTINATION_HEADER].string_value
                self.last_destinations = tuple(value.split(","))
                assert set(value.split(",")) <= allowed, f"routed outside the pool: {value}"
            common = (
                getattr(resp, kind).response
                if kind in ("request_headers", "request_body")
                else None
            )
            if common is not None:
                for h in common.header_mutation.set_headers:
                    if h.header.key == DESTINATION_HEADER:
                        assert set(h.header.raw_value.decode().split(",")) <= allowed


def run_sync(harness: RequestPath, loop: asyncio.AbstractEventLoop, case: Case) -> None:
    loop.run_until_complete(harness.run(case))
