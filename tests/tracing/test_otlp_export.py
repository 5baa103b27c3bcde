"""The production export path without Envoy: `open_tracer`'s batch processor and OTLP/gRPC
exporter deliver the spans to a real TraceService (the stack's receiver), and the receiver's
span tree shows them nested."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import TracingConfig
from extproc.stack.otlp import SpanReceiver, read_spans, span_tree
from extproc.tracing import open_tracer

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT = f"00-{TRACE:032x}-00f067aa0ba902b7-01"


@pytest.fixture
def receiver() -> Iterator[SpanReceiver]:
    with SpanReceiver() as r:
        yield r


def test_spans_reach_an_otlp_receiver_in_batches(receiver: SpanReceiver) -> None:
    tracer = open_tracer(
        TracingConfig(
            enabled=True, endpoint=f"http://{receiver.address}", service_name="gw",
            flush_interval_s=0.05,
        ),
        instance="host:1",
    )  # fmt: skip
    tracer.start()
    try:
        for _ in range(3):
            trace = tracer.begin(PARENT)
            with trace.phase("extproc.prepare"):
                pass
            trace.annotate({"gen_ai.request.model": "qwen3", "extproc.prompt.tokens": 12})
            trace.end()
        spans = receiver.wait_for(lambda got: len(got) == 6, timeout=10)
    finally:
        tracer.shutdown()
    assert len(spans) == 6
    assert {s.service for s in spans} == {"gw"}
    assert {s.trace_id for s in spans} == {f"{TRACE:032x}"}
    routes = [s for s in spans if s.name == "extproc.route"]
    assert {s.parent_span_id for s in routes} == {"00f067aa0ba902b7"}
    assert all(s.attributes["extproc.prompt.tokens"] == 12 for s in routes)
    tree = span_tree(spans, f"{TRACE:032x}").splitlines()
    assert tree[0] == f"trace {TRACE:032x}"
    # Envoy's span is not here: each routing span is a root, its phase indented under it.
    assert [line.split()[0] for line in tree[1:]] == ["extproc.route", "extproc.prepare"] * 3
    assert tree[1].startswith("  extproc.route [gw]") and tree[2].startswith("    extproc.prepare")


def test_shutdown_sends_what_is_still_queued(receiver: SpanReceiver) -> None:
    tracer = open_tracer(
        TracingConfig(enabled=True, endpoint=f"http://{receiver.address}", flush_interval_s=60)
    )
    tracer.start()
    tracer.begin(PARENT).end()
    tracer.shutdown()  # long before the minute's flush
    assert [s.name for s in receiver.spans()] == ["extproc.route"]


def test_the_receivers_log_reads_back_as_the_trees_extproc_traces_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "otlp.log"
    older = 0x1  # a trace of an earlier run, in the same (appended) log
    with SpanReceiver(log=log) as receiver:
        tracer = open_tracer(
            TracingConfig(enabled=True, endpoint=f"http://{receiver.address}", service_name="gw")
        )
        tracer.start()
        try:
            for trace_id in (older, TRACE):
                trace = tracer.begin(f"00-{trace_id:032x}-00f067aa0ba902b7-01")
                with trace.phase("extproc.prepare"):
                    pass
                trace.annotate({"gen_ai.request.model": "qwen3"})
                trace.end()
        finally:
            tracer.shutdown()
        received = receiver.wait_for(lambda got: len(got) == 4)
    assert read_spans(log) == received  # every field, attributes and events too
    assert main(["traces", "--workdir", str(tmp_path)]) == 0  # the newest trace
    out = capsys.readouterr().out
    assert out.strip() == span_tree(received, f"{TRACE:032x}")
    assert "extproc.prepare" in out and "gen_ai.request.model=qwen3" in out
    assert main(["traces", "--workdir", str(tmp_path), "--last", "2"]) == 0
    assert capsys.readouterr().out.count("trace ") == 2
    assert main(["traces", "--workdir", str(tmp_path), "f" * 32]) == 1
    assert f"no span of {'f' * 32} trace" in capsys.readouterr().err
    assert main(["traces", "--workdir", str(tmp_path / "none")]) == 1
    assert "extproc up --trace" in capsys.readouterr().err
