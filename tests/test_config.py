from __future__ import annotations

import pytest

from extproc.config import ConfigError, RouteSettings, load_config_text, parse_route_annotations

GOOD = """
server: {grpc_port: 9100, allow_explain: true}
routing: {default_strategy: prefix-cache}
models:
  - name: qwen3
    aliases: [qwen]
    tokenizer: bundled:qwen3
    endpoints:
      - {address: 127.0.0.1:8001, metrics_url: "http://127.0.0.1:8001/metrics", role: prefill}
      - {address: "[::1]:8002"}
routes:
  default/chat: {strategy: kv-aware, model_map: {gpt-4o: qwen3}}
"""


def test_good_config_decodes_every_section() -> None:
    cfg = load_config_text(GOOD)
    assert cfg.server.grpc_port == 9100 and cfg.server.allow_explain is True
    assert cfg.routing.default_strategy == "prefix-cache"
    assert cfg.models[0].aliases == ["qwen"]
    assert cfg.models[0].endpoints[0].role == "prefill"
    assert cfg.models[0].endpoints[1].address == "[::1]:8002"
    assert cfg.routes["default/chat"] == RouteSettings(
        strategy="kv-aware", model_map={"gpt-4o": "qwen3"}
    )
    # untouched sections keep their defaults
    assert cfg.metrics.poll_interval_s == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server: {grpc_prot: 1}", "server.grpc_prot: unknown key"),
        ("server: {grpc_port: '9002'}", "server.grpc_port: expected an integer"),
        ("server: {allow_explain: 1}", "server.allow_explain: expected true or false"),
        ("metrics: {preset: foo}", "metrics.preset: 'foo' is not one of"),
        ("models: [{name: a}]", "needs `endpoints` or `kubernetes`"),
        (
            "models: [{endpoints: [{address: '1.2.3.4:5'}]}]",
            "models[0].name: required key is missing",
        ),
        (
            "models: [{name: a, endpoints: [{address: nope}]}]",
            "models[0].endpoints[0]: address 'nope'",
        ),
        (
            "models: [{name: a, endpoints: [{address: '1.2.3.4:5', role: boss}]}]",
            "models[0].endpoints[0].role",
        ),
        (
            "models: [{name: a, endpoints: [{address: '1.1.1.1:1'}]}, {name: a, endpoints: [{address: '1.1.1.1:2'}]}]",
            "declared twice",
        ),
        ("server: [1, 2]", "server: expected a mapping"),
        ("server: {grpc_port: 1", "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text(text)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("annotations", "expected", "n_errors"),
    [
        ({}, RouteSettings(), 0),
        ({"lb.extproc.io/strategy": "prefix-cache"}, RouteSettings(strategy="prefix-cache"), 0),
        (
            {"lb.extproc.io/scorers": "prefix-cache:3, least-request:1"},
            RouteSettings(scorers="prefix-cache:3,least-request:1"),
            0,
        ),
        (
            {"lb.extproc.io/model-map": "gpt-4o=qwen3,small=qwen3"},
            RouteSettings(model_map={"gpt-4o": "qwen3", "small": "qwen3"}),
            0,
        ),
        ({"lb.extproc.io/accounting": "off"}, RouteSettings(accounting=False), 0),
        ({"lb.extproc.io/accounting": "maybe"}, RouteSettings(), 1),
        ({"lb.extproc.io/strategy": "Bad Name!"}, RouteSettings(), 1),
        ({"lb.extproc.io/scorers": "prefix-cache:x"}, RouteSettings(), 1),
        ({"lb.extproc.io/model-map": "broken"}, RouteSettings(), 1),
        ({"lb.extproc.io/stratgy": "random"}, RouteSettings(), 1),
        ({"kubectl.kubernetes.io/last-applied-configuration": "{}"}, RouteSettings(), 0),
    ],
)
def test_route_annotations(
    annotations: dict[str, str], expected: RouteSettings, n_errors: int
) -> None:
    settings, errors = parse_route_annotations(annotations)
    assert settings == expected
    assert len(errors) == n_errors
    for error in errors:
        assert error.startswith("lb.extproc.io/")
