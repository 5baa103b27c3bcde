"""The `tracing:` section: off by default, strict, and with tracing off OpenTelemetry is never
imported (a server process that does not trace pays nothing for it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extproc.config import ConfigError, TracingConfig, load_config_text
from extproc.tracing import NO_TRACER, open_tracer


def test_tracing_is_off_by_default() -> None:
    config = load_config_text("models: []\n")
    assert config.tracing == TracingConfig()
    assert not config.tracing.enabled
    assert open_tracer(config.tracing) is NO_TRACER


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sample_ratio: 1.5", "tracing.sample_ratio: 1.5 must be in 0..1"),
        ("sample_ratio: -0.1", "tracing.sample_ratio"),
        ("endpoint: collector:4317", "tracing.endpoint: expected http(s)://host:port"),
        ("flush_interval_s: 0", "tracing.flush_interval_s"),
        ("ratio: 0.5", "tracing.ratio: unknown key"),
    ],
)
def test_a_bad_tracing_setting_names_its_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config_text(f"tracing:\n  {text}\n")
    assert message in str(raised.value)


def test_a_server_without_tracing_never_imports_opentelemetry() -> None:
    """The whole server built (App: director, gRPC server, admin) from a config without
    tracing, and a request routed through the director: no `opentelemetry` module loaded."""
    code = """
import asyncio, sys
import orjson
from extproc.app import App
from extproc.config import load_config_text
from extproc.director.api import RequestHead
app = App(load_config_text('''
models:
  - name: m
    endpoints: [{address: "127.0.0.1:9"}]
routing: {default_strategy: least-request}
'''))
head = RequestHead("r", "POST", "/v1/chat/completions", {}, traceparent=None)
body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
asyncio.run(app.director.route(head, body))
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_with_tracing_on_the_sdk_is_loaded_only_when_asked() -> None:
    tracer = open_tracer(TracingConfig(enabled=True))
    assert tracer is not NO_TRACER
    tracer.shutdown()  # never started: nothing to flush, nothing bound
