"""`extproc up --trace`: Envoy's OpenTelemetry tracer, the servers' `tracing:` and (alone) the
stack's own OTLP receiver, all pointed at one address."""

from __future__ import annotations

import argparse

import pytest
import yaml

from extproc.config import load_config_text
from extproc.stack.cli import (
    LOCAL_RECEIVER,
    add_up_arguments,
    options_from_args,
    ready_text,
    shape_problems,
)
from extproc.stack.envoy_config import OTLP_CLUSTER, HostPort, render_bootstrap
from extproc.stack.local import LocalStack


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser


@pytest.mark.parametrize(
    ("argv", "address", "receiver"),
    [
        (["--trace"], LOCAL_RECEIVER, True),
        (["--trace", "10.0.0.9:4317"], "10.0.0.9:4317", False),
    ],
)
def test_envoy_and_the_servers_trace_to_one_address(
    argv: list[str], address: str, receiver: bool
) -> None:
    opts = options_from_args(_parser().parse_args(argv), {})
    assert (opts.tracing, opts.trace_receiver) == (address, receiver)
    stack = LocalStack(opts)
    config = load_config_text(yaml.safe_dump(stack.server_config())).tracing
    assert config.enabled and config.endpoint == f"http://{address}"
    envoy = stack.envoy_options()
    assert envoy.tracing == HostPort.parse(address)
    bootstrap = render_bootstrap(envoy)
    (otlp,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == OTLP_CLUSTER]
    endpoint = otlp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["port_value"] == HostPort.parse(address).port
    (hcm,) = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    provider = hcm["typed_config"]["tracing"]["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    assert (HostPort.parse(address).port in stack.ports()) is receiver
    said = ready_text(stack, ".run")
    assert "traces:" in said and ("otlp.log" in said) is receiver


def test_without_trace_nothing_traces() -> None:
    stack = LocalStack(options_from_args(_parser().parse_args([]), {}))
    assert "tracing" not in stack.server_config()
    assert "traces:" not in ready_text(stack, ".run")
    assert (
        "tracing"
        not in render_bootstrap(stack.envoy_options())["static_resources"]["listeners"][0][
            "filter_chains"
        ][0]["filters"][0]["typed_config"]
    )


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--trace", "nohost"], "--trace:"),
        (["--trace", "--gateway-shape", "envoy-gateway"], "--trace needs the local shape"),
    ],
)
def test_a_trace_option_that_cannot_work_is_refused(argv: list[str], problem: str) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    defaults = {a.dest: a.default for a in parser._actions}
    assert any(p.startswith(problem) for p in shape_problems(args, defaults))
