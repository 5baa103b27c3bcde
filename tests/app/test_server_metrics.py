"""The server's own tallies reach /metrics at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from extproc.app import App
from extproc.config import load_config_text


async def test_stream_ends_are_exported_as_a_counter() -> None:
    app = App(load_config_text('models:\n  - name: m\n    endpoints: [{address: "127.0.0.1:9"}]\n'))
    app.server.stream_ends["cancelled"] += 3
    app.server.stream_ends["done"] += 1
    samples = {
        (s.name, s.labels.get("end")): s.value
        for fam in text_string_to_metric_families(app.metrics.render().decode())
        for s in fam.samples
        if s.name.startswith("extproc_grpc_stream_ends")
    }
    assert samples == {
        ("extproc_grpc_stream_ends_total", "cancelled"): 3.0,
        ("extproc_grpc_stream_ends_total", "done"): 1.0,
    }
    app.server.stream_ends["cancelled"] += 1  # read at scrape time, no copy to keep in sync
    assert b'extproc_grpc_stream_ends_total{end="cancelled"} 4.0' in app.metrics.render()
