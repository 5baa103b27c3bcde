from __future__ import annotations

from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import ConfigError, RouteSettings, load_config_text, parse_route_annotations
from extproc.routing.settings import build_strategies, route_annotations

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
            "models[0].endpoints[0].address: 'nope' must be ip:port",
        ),
        (
            "models: [{name: a, endpoints: [{address: '1.2.3.4:5', role: boss}]}]",
            "models[0].endpoints[0].role",
        ),
        (
            "models: [{name: a, endpoints: [{address: '1.1.1.1:1'}]}, {name: a, endpoints: [{address: '1.1.1.1:2'}]}]",
            "declared twice",
        ),
        ("flow_control: {reserved_slots: -1}", "flow_control.reserved_slots: -1 must be >= 0"),
        ("routing: {max_fallbacks: -1}", "routing.max_fallbacks: -1 must be >= 0"),
        ("server: {metrics_port: 70000}", "server.metrics_port: 70000 must be in 1..65535"),
        (
            "models: [{name: a, endpoints: [{address: '127.0.0.1:99999'}]}]",
            "models[0].endpoints[0].address: '127.0.0.1:99999': port must be in 1..65535",
        ),
        (
            "models: [{name: a, block_size: 0, endpoints: [{address: '1.1.1.1:1'}]}]",
            "models[0].block_size: 0 must be >= 1",
        ),
        (
            "models: [{name: a, kubernetes: {target_port: 0}}]",
            "models[0].kubernetes.target_port: 0 must be in 1..65535",
        ),
        ("metrics: {timeout_s: 0}", "metrics.timeout_s: 0.0 must be > 0"),
        ("server: [1, 2]", "server: expected a mapping"),
        ("server: {grpc_port: 1", "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text(text)
    assert message in str(err.value)


def test_checks_of_a_section_run_past_schema_errors_elsewhere() -> None:
    """An unknown key does not hide the range and cross-field checks: one error carries all."""
    text = (
        "server: {grpc_prot: 1, metrics_port: 0}\n"
        "routing: {max_fallbacks: -2, seed: x}\n"
        "models:\n"
        "  - {name: a}\n"
        "  - {name: a, endpoints: [{address: '1.1.1.1:1'}]}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config_text(text)
    assert [str(e).split(": ")[0] for e in err.value.errors] == [
        "server.grpc_prot",
        "server.metrics_port",
        "routing.seed",
        "routing.max_fallbacks",
        "models[0] (a)",
        "models[1]",
    ]


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


# ---------------------------------------------------------------- routing settings
# The routing section names plugins that only the routing layer knows: `build_strategies` checks
# it right after loading (start-up in the CLI and App, every reload in App), with key paths.

MODEL = "models: [{name: m, endpoints: [{address: '127.0.0.1:9'}]}]\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "routing: {profiles: {my-profile: {scorers: [{type: queue}, {type: prefx}]}}}",
            "routing.profiles.my-profile.scorers[1].type: unknown scorer 'prefx' (known: busy-time,",
        ),
        (
            "routing: {profiles: {p: {scorers: [{type: queue, weight: -2}]}}}",
            "routing.profiles.p.scorers[0].weight: must be >= 0",
        ),
        (
            "routing: {profiles: {p: {scorers: [{type: queue}], picker: {type: softmax, "
            "params: {temperature: 0}}}}}",
            "routing.profiles.p.picker.params: temperature must be > 0",
        ),
        (
            "routing: {profiles: {p: {filters: [{type: saturation, params: {kv: 1}}], "
            "scorers: [{type: queue}]}}}",
            "routing.profiles.p.filters[0].params.kv: unknown key (allowed: headroom,",
        ),
        ("routing: {profiles: {p: {scorer: []}}}", "routing.profiles.p.scorer: unknown key"),
        (
            "routing: {profiles: {kv-aware: {scorers: [{type: queue}]}}}",
            "routing.profiles.kv-aware: name 'kv-aware' is already used",
        ),
        (
            "routing: {strategy_params: {prefix-cache: {stddev: 2}}}",
            "routing.strategy_params.prefix-cache.stddev: unknown key (allowed: "
            "imbalance_abs_count, match_threshold_percent, stddev_factor)",
        ),
        (
            "routing: {strategy_params: {kv-aware: {temperature: hot}}}",
            "routing.strategy_params.kv-aware.temperature: must be float, got str 'hot'",
        ),
        (
            "routing: {strategy_params: {kv-awere: {}}}",
            "routing.strategy_params.kv-awere: unknown strategy 'kv-awere' (known: higress-gpu,",
        ),
        (
            "routing: {default_strategy: least-requests}",
            "routing.default_strategy: incorrect routing strategy 'least-requests': "
            "did you mean 'least-request'? (known: gaie,",
        ),
        (
            "routing: {default_strategy: 'prefix-cache:3,least-reqest:1'}",
            "routing.default_strategy: invalid routing strategy 'prefix-cache:3,least-reqest:1': "
            "unknown scorer 'least-reqest'",
        ),
        (
            "models: [{name: m, strategy: prefx-cache, endpoints: [{address: '127.0.0.1:9'}]}]",
            "models[0].strategy: incorrect routing strategy 'prefx-cache'",
        ),
        (
            "routes: {default/chat: {profile: missing}}",
            "routes.default/chat.profile: incorrect routing strategy 'missing'",
        ),
        (
            "routes: {default/chat: {scorers: 'queue:x'}}",
            "routes.default/chat.scorers: invalid routing strategy 'queue:x': weight of 'queue'",
        ),
    ],
)
def test_bad_routing_settings_name_the_key_path(text: str, message: str) -> None:
    config = load_config_text(("" if "models:" in text else MODEL) + text)
    with pytest.raises(ConfigError) as err:
        build_strategies(config)
    assert str(err.value).startswith(message)


def test_good_routing_settings_build_every_name_they_use() -> None:
    config = load_config_text(
        MODEL.replace("name: m,", "name: m, strategy: cache-heavy,")
        + """
routing:
  default_strategy: "prefix-cache:3,least-request:1"
  profiles:
    cache-heavy:
      filters: [{type: low-queue, params: {threshold: 16}}]
      scorers: [{type: prefix-cache-scorer, weight: 3}, {type: queue}]
      picker: {type: softmax, params: {temperature: 0.2}}
  strategy_params: {kv-aware: {temperature: 0.1}, higress-gpu: {kv_cache_threshold: 0.7}}
routes:
  default/chat: {strategy: pd, scorers: "queue:1,prefix:2"}
"""
    )
    registry = build_strategies(config)
    assert "cache-heavy" in registry.names()
    assert registry.resolve("cache-heavy").capabilities.prefix_matches
    assert registry.resolve("pd").capabilities.disaggregated


def test_cli_refuses_a_typo_in_a_profile_with_the_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(MODEL + "routing: {profiles: {my-profile: {scorers: [{type: prefx}]}}}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"extproc: invalid config:\n  {path}:")
    assert ": routing.profiles.my-profile.scorers[0].type: unknown scorer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("annotations", "expected", "errors"),
    [
        ({"lb.extproc.io/strategy": "kv-aware"}, RouteSettings(strategy="kv-aware"), []),
        (
            {"lb.extproc.io/strategy": "kv-awere", "lb.extproc.io/accounting": "off"},
            RouteSettings(accounting=False),
            ["lb.extproc.io/strategy: incorrect routing strategy 'kv-awere'"],
        ),
        (
            {"lb.extproc.io/profile": "cache-heavy"},
            RouteSettings(),
            ["lb.extproc.io/profile: incorrect routing strategy 'cache-heavy'"],
        ),
        (
            {"lb.extproc.io/scorers": "queue:1,prefx:2"},
            RouteSettings(),
            ["lb.extproc.io/scorers: invalid routing strategy 'queue:1,prefx:2': unknown scorer"],
        ),
    ],
)
def test_route_annotations_naming_unknown_strategies_are_reported_and_unset(
    annotations: dict[str, str], expected: RouteSettings, errors: list[str]
) -> None:
    registry = build_strategies(load_config_text(MODEL))
    settings, found = route_annotations(parse_route_annotations, lambda: registry)(annotations)
    assert settings == expected
    assert len(found) == len(errors)
    for got, want in zip(found, errors, strict=True):
        assert got.startswith(want)
