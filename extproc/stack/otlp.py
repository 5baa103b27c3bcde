"""A small OTLP/gRPC trace receiver for the local stack and its tests: the real
`opentelemetry.proto.collector.trace.v1.TraceService`, keeping what Envoy and the servers
export, and the span tree of a trace as text (docs/operations.md, "Traces").

Not a collector: it keeps the last spans in memory (bounded) and, given a file, writes one line
of JSON per span as it arrives, which `extproc traces` reads back as span trees.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc
from opentelemetry.proto.common.v1 import common_pb2

__all__ = ["ReceivedSpan", "SpanReceiver", "newest_traces", "read_spans", "span_line", "span_tree"]

MAX_SPANS = 50_000


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span, flattened: ids in hex, attributes as Python values."""

    service: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    events: tuple[tuple[str, int, Mapping[str, Any]], ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _flatten(request: ts.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        service=service, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), name=s.name, kind=int(s.kind),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=tuple(
                            (e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events
                        ),
                        status_code=int(s.status.code), status_message=s.status.message,
                    )
                )  # fmt: skip
    return out


class _TraceService(ts_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, take: Callable[[list[ReceivedSpan]], None]) -> None:
        self._take = take

    def Export(
        self, request: ts.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> ts.ExportTraceServiceResponse:
        self._take(_flatten(request))
        return ts.ExportTraceServiceResponse()


class SpanReceiver:
    """Receives OTLP/gRPC trace exports on `host:port` (0: any free port) from `start()` to
    `stop()`; `spans()` is what arrived (the last `MAX_SPANS`), `log` gets a JSON line per
    span (`span_line`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, log: Path | None = None) -> None:
        self.host = host
        self._port = port
        self._log_path = log
        self._log: IO[str] | None = None
        self._spans: deque[ReceivedSpan] = deque(maxlen=MAX_SPANS)
        self._lock = threading.Condition()
        self._server: grpc.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        ts_grpc.add_TraceServiceServicer_to_server(_TraceService(self._take), server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port(f"{self.host}:{self._port}")
        if port == 0:
            raise OSError(f"cannot bind the OTLP receiver to {self.host}:{self._port}")
        if self._log_path is not None:
            self._log = self._log_path.open("a", encoding="utf-8")
        server.start()
        self._port, self._server = port, server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(0.5).wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SpanReceiver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _take(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            if self._log is not None:
                self._log.writelines(span_line(s) + "\n" for s in spans)
                self._log.flush()
            self._lock.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds (or what arrived by `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return list(self._spans)


def span_line(span: ReceivedSpan) -> str:
    """One span as a line of JSON: what the receiver's `log` gets and `read_spans` reads."""
    fields = dataclasses.asdict(span)
    return json.dumps(fields, default=str, separators=(",", ":"))


def read_spans(path: Path) -> list[ReceivedSpan]:
    """The spans a receiver logged to `path`, in order (a line that does not parse, such as
    one cut by a crash, is skipped). OSError if the file cannot be read."""
    spans = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                d = json.loads(line)
                d["events"] = tuple((n, t, a) for n, t, a in d["events"])
                spans.append(ReceivedSpan(**d))
            except (ValueError, TypeError, KeyError):
                continue
    return spans


def newest_traces(spans: Iterable[ReceivedSpan], n: int) -> list[str]:
    """The ids of the `n` traces whose last span started last, oldest first."""
    last: dict[str, int] = {}
    for s in spans:
        last[s.trace_id] = max(last.get(s.trace_id, 0), s.start_ns)
    return sorted(last, key=last.__getitem__)[-n:] if n > 0 else []


_SHOWN = (
    "gen_ai.request.model", "extproc.strategy", "extproc.endpoint", "extproc.prompt.tokens",
    "extproc.prefix.hit_blocks", "extproc.priority", "http.response.status_code", "error.type",
    "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "extproc.ttft_s",
)  # fmt: skip


def span_tree(
    spans: Iterable[ReceivedSpan], trace_id: str, *, shown: Iterable[str] = _SHOWN
) -> str:
    """One trace as an indented tree (children by start time), each span with its service,
    its offset from the trace's start and duration, and the `shown` attributes it has."""
    mine = [s for s in spans if s.trace_id == trace_id]
    if not mine:
        return ""
    ids = {s.span_id for s in mine}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in mine:
        parent = s.parent_span_id if s.parent_span_id in ids else ""
        children.setdefault(parent, []).append(s)
    t0 = min(s.start_ns for s in mine)
    keys = tuple(shown)
    lines = [f"trace {trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            attrs = " ".join(f"{k}={s.attributes[k]}" for k in keys if k in s.attributes)
            offset = (s.start_ns - t0) / 1e6
            line = f"{'  ' * depth}{s.name} [{s.service}] +{offset:.2f}ms {s.duration_ms:.2f}ms"
            lines.append(f"{line}  {attrs}".rstrip())
            walk(s.span_id, depth + 1)

    walk("", 1)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m extproc.stack.otlp --port N [--log FILE]`: a receiver until SIGTERM/SIGINT
    (the benchmarks' span sink: a process of its own, so its CPU is no one else's)."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m extproc.stack.otlp", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4317)
    p.add_argument("--log", type=Path, default=None, help="a JSON line per span received")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with SpanReceiver(args.host, args.port, log=args.log) as receiver:
        print(f"OTLP/gRPC receiver on {receiver.address}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
