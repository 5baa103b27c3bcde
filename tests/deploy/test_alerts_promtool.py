"""The alerts and the dashboard's PromQL through Prometheus's own tool (`promtool`, from
Debian's prometheus package: `make promtool`): every expression parses, every alert template
renders, and each alert fires on the series that should fire it and only on those
(`promtool test rules` with synthetic series, one scenario per alert and a quiet twin)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy._dashboard import OVERLAY, custom_variable_values, dashboard_exprs
from tests.deploy._manifests import find, render

PROMTOOL = shutil.which("promtool", path=str(Path(sys.executable).parent)) or shutil.which(
    "promtool"
)
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: `make promtool` (CI runs it)"
)


def groups() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = find(render(OVERLAY), "PrometheusRule")["spec"]["groups"]
    return out


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_rules_parse_and_their_templates_render(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups()}))
    result = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups())} rules found" in result.stdout


GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "${__rate_interval}": "5m",
    "$model": ".*",
    "${model}": ".*",
    **custom_variable_values(),
}


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    rules = []
    for i, (where, expr) in enumerate(dashboard_exprs()):
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: unknown Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", path.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


EXT, QUIET = "extproc", "quiet"  # the namespace that should alert, and its quiet twin


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def _histogram(name: str, per_minute: dict[str, int], minutes: int, **labels: str) -> list[Any]:
    """Cumulative bucket counters growing by `per_minute[le]` every minute."""
    return [
        _series(f"{name}_bucket", f"0+{n}x{minutes}", le=le, **labels)
        for le, n in per_minute.items()
    ]


def _loud_and_quiet(name: str, loud: dict[str, int], quiet: dict[str, int]) -> list[Any]:
    """A histogram in the namespace that should alert and its twin that should not."""
    return _histogram(name, loud, 30, namespace=EXT, pod="r0") + _histogram(
        name, quiet, 30, namespace=QUIET, pod="q0"
    )


SCENARIOS: list[dict[str, Any]] = [
    {
        "name": "no ready endpoint for qwen3; llama ready on one replica",
        "series": [
            _series(
                "extproc_endpoint_ready", "0x10", namespace=EXT, pod=r, model="qwen3", endpoint=e
            )
            for r in ("r0", "r1")
            for e in ("10.0.0.1:8000", "10.0.0.2:8000")
        ]
        + [
            _series(
                "extproc_endpoint_ready",
                v,
                namespace=EXT,
                pod=r,
                model="llama",
                endpoint="10.0.1.1:8000",
            )
            for r, v in (("r0", "0x10"), ("r1", "1x10"))
        ],
        "alerts": [
            ("0m", "ExtprocNoReadyEndpoint", []),  # pending: for 1m
            (
                "2m",
                "ExtprocNoReadyEndpoint",
                [{"namespace": EXT, "model": "qwen3", "severity": "critical"}],
            ),
            ("4m", "ExtprocEndpointStale", []),
            (
                "6m",
                "ExtprocEndpointStale",
                [
                    {"namespace": EXT, "model": "qwen3", "endpoint": e, "severity": "warning"}
                    for e in ("10.0.0.1:8000", "10.0.0.2:8000")
                ],
            ),
        ],
    },
    {
        "name": "one endpoint stalled",
        "series": [
            _series(
                "extproc_endpoint_stalled",
                "1x10",
                namespace=EXT,
                pod="r0",
                endpoint="10.0.0.1:8000",
            ),
            _series(
                "extproc_endpoint_stalled",
                "0x10",
                namespace=EXT,
                pod="r0",
                endpoint="10.0.0.2:8000",
            ),
        ],
        "alerts": [
            ("1m", "ExtprocEndpointStalled", []),
            (
                "3m",
                "ExtprocEndpointStalled",
                [{"namespace": EXT, "endpoint": "10.0.0.1:8000", "severity": "warning"}],
            ),
        ],
    },
    {
        "name": "decisions take ~50 ms in one namespace, under 1 ms in the other",
        "series": _loud_and_quiet(
            "extproc_routing_decision_seconds",
            {"0.001": 0, "0.025": 0, "0.05": 100, "+Inf": 100},
            {"0.001": 100, "0.025": 100, "0.05": 100, "+Inf": 100},
        ),
        "alerts": [
            ("9m", "ExtprocDecisionLatencyHigh", []),  # pending: for 10m
            ("20m", "ExtprocDecisionLatencyHigh", [{"namespace": EXT, "severity": "warning"}]),
        ],
    },
    {
        "name": "10% of routed requests never accounted; the twin accounts them all on another replica",
        "series": [
            _series(
                "extproc_routed_requests_total", "0+1000x60", namespace=EXT, pod="r0", model="qwen3"
            ),
            _series(
                "extproc_access_records_total",
                "0+900x60",
                namespace=EXT,
                pod="r1",
                result="accounted",
            ),
            _series(
                "extproc_routed_requests_total",
                "0+1000x60",
                namespace=QUIET,
                pod="q0",
                model="qwen3",
            ),
            _series(
                "extproc_access_records_total",
                "0+1000x60",
                namespace=QUIET,
                pod="q1",
                result="accounted",
            ),
            _series(
                "extproc_access_records_total",
                "0+50x60",
                namespace=QUIET,
                pod="q1",
                result="unrouted",
            ),
        ],
        "alerts": [
            ("14m", "ExtprocAccountingLoss", []),  # pending: for 15m
            ("40m", "ExtprocAccountingLoss", [{"namespace": EXT, "severity": "warning"}]),
        ],
    },
    {
        "name": "leases expire in one gateway: its records are lost",
        "series": [
            _series("extproc_lease_ends_total", "0+100x60", namespace=EXT, pod="r0", how="record"),
            _series("extproc_lease_ends_total", "0+10x60", namespace=EXT, pod="r1", how="expired"),
            _series("extproc_lease_ends_total", "0+100x60", namespace=QUIET, pod="q0", how="peer"),
            _series(
                "extproc_lease_ends_total", "0+1x60", namespace=QUIET, pod="q0", how="handed_off"
            ),
        ],
        "alerts": [
            ("14m", "ExtprocLeasesExpiring", []),  # pending: for 15m
            ("40m", "ExtprocLeasesExpiring", [{"namespace": EXT, "severity": "warning"}]),
        ],
    },
    {
        "name": "flow control rejects a tenth of one model's requests",
        "series": [
            _series(
                "extproc_flow_control_outcomes_total",
                "0+90x40",
                namespace=EXT,
                pod="r0",
                model="m",
                priority="0",
                outcome="dispatched",
            ),
            _series(
                "extproc_flow_control_outcomes_total",
                "0+10x40",
                namespace=EXT,
                pod="r0",
                model="m",
                priority="0",
                outcome="rejected-ttl-expired",
            ),
            _series(
                "extproc_flow_control_outcomes_total",
                "0+100x40",
                namespace=QUIET,
                pod="q0",
                model="m",
                priority="0",
                outcome="dispatched",
            ),
            _series(
                "extproc_flow_control_outcomes_total",
                "0+1x40",
                namespace=QUIET,
                pod="q0",
                model="m",
                priority="0",
                outcome="cancelled",
            ),
        ],
        "alerts": [
            ("9m", "ExtprocFlowControlRejecting", []),  # pending: for 10m
            (
                "30m",
                "ExtprocFlowControlRejecting",
                [{"namespace": EXT, "model": "m", "severity": "warning"}],
            ),
        ],
    },
    {
        "name": "KV events from one pod stop",
        "series": [
            _series("extproc_kv_events_healthy", "0x10", namespace=EXT, pod="10.0.0.1:8000"),
            _series("extproc_kv_events_healthy", "1x10", namespace=EXT, pod="10.0.0.2:8000"),
        ],
        "alerts": [
            ("4m", "ExtprocKVEventsDown", []),
            (
                "6m",
                "ExtprocKVEventsDown",
                [{"namespace": EXT, "pod": "10.0.0.1:8000", "severity": "warning"}],
            ),
        ],
    },
    {
        "name": "three replicas: r2 is off the bus and hears one peer",
        "series": [
            _series("extproc_sync_connected", v, namespace=EXT, pod=r)
            for r, v in (("r0", "1x10"), ("r1", "1x10"), ("r2", "0x10"))
        ]
        + [
            _series("extproc_sync_peers", v, namespace=EXT, pod=r)
            for r, v in (("r0", "2x10"), ("r1", "2x10"), ("r2", "1x10"))
        ]
        + [_series("extproc_sync_connected", "1x10", namespace=QUIET, pod=r) for r in ("q0", "q1")]
        + [_series("extproc_sync_peers", "1x10", namespace=QUIET, pod=r) for r in ("q0", "q1")],
        "alerts": [
            (
                "3m",
                "ExtprocSyncDisconnected",
                [{"namespace": EXT, "pod": "r2", "severity": "warning"}],
            ),
            (
                "6m",
                "ExtprocSyncPeersMissing",
                [{"namespace": EXT, "pod": "r2", "severity": "warning"}],
            ),
        ],
    },
    {
        "name": "peer messages arrive ~2 s late in one namespace",
        "series": _loud_and_quiet(
            "extproc_sync_lag_seconds",
            {"0.01": 0, "1.0": 0, "2.5": 60, "+Inf": 60},
            {"0.01": 60, "1.0": 60, "2.5": 60, "+Inf": 60},
        ),
        "alerts": [
            ("20m", "ExtprocSyncLagHigh", [{"namespace": EXT, "severity": "warning"}]),
        ],
    },
]


def _without_annotations(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """promtool compares annotations exactly; they are checked by the tests above instead."""
    return [
        {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in groups
    ]


def run_unit_tests(
    tmp_path: Path, rule_groups: list[dict[str, Any]], scenarios: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` of `scenarios` against `rule_groups` (annotations left out:
    promtool compares them exactly; the tests above check them)."""
    plain = [
        {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in rule_groups
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": plain}))
    tests = [
        {
            "name": s["name"],
            "interval": "1m",
            "input_series": s["series"],
            "alert_rule_test": [
                {
                    "eval_time": at,
                    "alertname": alert,
                    "exp_alerts": [{"exp_labels": labels} for labels in expected],
                }
                for at, alert, expected in s["alerts"]
            ],
        }
        for s in scenarios
    ]
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    return promtool("test", "rules", "tests.yaml", cwd=tmp_path)


def test_each_alert_fires_on_its_scenario_and_only_there(tmp_path: Path) -> None:
    result = run_unit_tests(tmp_path, groups(), SCENARIOS)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {alert for s in SCENARIOS for _, alert, expected in s["alerts"] if expected}
    defined = {r["alert"] for g in groups() for r in g["rules"]}
    assert tested == defined, f"alerts without a firing scenario: {defined - tested}"


def test_promtool_catches_a_broken_alert(tmp_path: Path) -> None:
    # The harness can fail: an alert whose comparison was flipped fires on the wrong pod.
    broken = groups()
    rule = next(r for g in broken for r in g["rules"] if r["alert"] == "ExtprocKVEventsDown")
    rule["expr"] = re.sub(r"== 0$", "== 1", rule["expr"].strip())
    scenario = next(s for s in SCENARIOS if s["name"] == "KV events from one pod stop")
    assert run_unit_tests(tmp_path, broken, [scenario]).returncode != 0
